"""A dataset written whole or not at all, over nothing that was there before. On a
filesystem: into a staging directory beside it, renamed into place when the writing
ends, removed if it fails (a prepared dataset, a teacher cache, an instruction
dataset). An object store has no rename: there the files go to their place and the
manifest, written last, is what makes the dataset complete; a failure removes the
files this run wrote, one by one, and nothing else."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from lmforge.data import storage


@contextmanager
def staged(out: Path | str, field: str = "data.path"):
    """Yields where to write `out`'s contents: a staging `Path`, or the URI itself.
    `out` must be new or empty (`UserError` naming `field` otherwise)."""
    storage.require_empty(str(out), field)
    if storage.is_uri(str(out)):
        before = storage.files_below(str(out), field)  # empty but for what another writer adds meanwhile
        try:
            yield str(out)
        except BaseException:
            storage.remove_files(storage.files_below(str(out), field) - before, str(out))
            raise
        return
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()  # checked empty above; a directory someone filled since is not replaced
    staging.rename(out)
