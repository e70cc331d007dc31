"""A directory written whole or not at all: into a staging directory beside it,
renamed into place when the writing ends, removed if it fails (a prepared dataset,
a teacher cache, an instruction dataset)."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged(out: Path):
    """Yields the directory to write `out`'s contents into."""
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
        out.rmdir()  # only an empty directory may be replaced
    staging.rename(out)
