"""Where checkpoints live and when one counts as committed.

Layout under the job's checkpoint directory (a local path or an fsspec URI):
`step_00000050/` holds the DCP shards written by every rank, `rng/rank_N.safetensors`
per rank, `state.json` (step, data cursor, schedule; rank 0) and, written last,
`commit.json` with every file's size and sha256. Only directories with a valid
`commit.json` are ever loaded. A step that read back and did not match is set aside
as `corrupt_step_00000050` (never deleted); one that could not be read is left as it
is (`CheckpointUnreadable`: the attempt fails and may be retried).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import fsspec
from fsspec.implementations.local import LocalFileSystem
from pydantic import ValidationError

from lmforge.checkpoint.state import TrainerState
from lmforge.errors import UserError

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step_(\d{8})$")
COMMIT = "commit.json"
STATE = "state.json"
SET_ASIDE = "corrupt_"  # + the step directory's name: a checkpoint that failed its checks, kept for a look


class CheckpointUnreadable(Exception):
    """A checkpoint's files could not be read (storage down, permissions): not corruption."""


def is_checkpoint(path: str | os.PathLike) -> bool:
    """A step directory, committed or not (a model directory is none)."""
    path = Path(path)
    return (path / COMMIT).is_file() or (path / STATE).is_file() or re.fullmatch(r"step_\d+", path.name) is not None


@dataclass(frozen=True)
class CommittedCheckpoint:
    step: int
    path: str  # as given to DCP: a local path or a URI
    state: TrainerState


def join_path(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


class CheckpointStore:
    def __init__(self, root: str):
        self.root = root
        # Listings uncached: other processes (the ranks) add checkpoints this one must see.
        self.fs, self._fs_root = fsspec.core.url_to_fs(root, use_listings_cache=False)
        self.is_uri = "://" in root and not root.startswith("file://")

    def step_path(self, step: int) -> str:
        return join_path(self.root, f"step_{step:08d}")

    def fs_path(self, path: str) -> str:
        return fsspec.core.url_to_fs(path)[1]

    def check_usable(self) -> None:
        """Pre-flight without writing anything: the directory exists and lists, or the
        nearest existing parent is a writable directory. Raises `UserError`."""
        try:
            if self.fs.exists(self._fs_root):
                if not self.fs.isdir(self._fs_root):
                    raise NotADirectoryError("it is a file")
                self.fs.ls(self._fs_root)
                return
            if self.is_uri:
                return  # object stores create prefixes on first write
            parent = os.path.dirname(os.path.abspath(self._fs_root))
            while not os.path.exists(parent):
                parent = os.path.dirname(parent)
            if not os.path.isdir(parent):
                raise NotADirectoryError(f"{parent} is a file")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise PermissionError(f"{parent} is not writable")
        except (OSError, ValueError) as err:
            raise UserError(f"checkpoint.dir: {self.root} is not a usable directory ({err})") from None

    def committed(self) -> list[int]:
        """Steps with a readable commit marker, oldest first."""
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self._fs_root, detail=False)]
        except FileNotFoundError:
            return []
        steps = sorted(int(m.group(1)) for n in names if (m := STEP_DIR.match(n)))
        return [s for s in steps if self.fs.exists(self.fs_path(join_path(self.step_path(s), COMMIT)))]

    def checkpoint(self, step: int) -> Optional[CommittedCheckpoint]:
        """A committed step with its state, or None when state.json is missing or not a
        trainer state (`CheckpointUnreadable` when it could not be read)."""
        path = self.step_path(step)
        try:
            with self.fs.open(self.fs_path(join_path(path, STATE))) as f:
                state = TrainerState.model_validate_json(f.read())
        except (FileNotFoundError, ValidationError):
            state = None
        except OSError as err:
            raise CheckpointUnreadable(f"{path}/{STATE}: {err}") from err
        if state is None:
            log.warning("checkpoint %s has no readable state.json; trying the previous one", path)
            return None
        return CommittedCheckpoint(step=step, path=path, state=state)

    def latest(self) -> Optional[CommittedCheckpoint]:
        """The newest committed step with a readable state (files not checksummed: see
        `sharded.restore_point`, which the ranks use before loading)."""
        for step in reversed(self.committed()):
            if ckpt := self.checkpoint(step):
                return ckpt
        return None

    def write_state(self, step: int, state: TrainerState) -> None:
        self._write_json(join_path(self.step_path(step), STATE), state.as_json())

    def _write_json(self, path: str, value: dict) -> None:
        """Whole or not at all: renamed into place on a filesystem (an object store's put is atomic)."""
        data = json.dumps(value, indent=2).encode()
        target = self.fs_path(path)
        if isinstance(self.fs, LocalFileSystem):
            staging = f"{target}.partial-{os.getpid()}"
            with open(staging, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(staging, target)
        else:
            self.fs.pipe_file(target, data)

    def files(self, step: int) -> list[str]:
        """Every file of a step, relative to its directory, sorted (commit.json aside)."""
        base = self.fs_path(self.step_path(step)).rstrip("/")
        return sorted(p[len(base) + 1 :] for p in self.fs.find(base) if p[len(base) + 1 :] != COMMIT)

    def digest(self, step: int, names: list[str]) -> dict[str, dict]:
        """Size and sha256 of some of a step's files, read in 8 MiB chunks."""
        out = {}
        for name in names:
            sha, size = hashlib.sha256(), 0
            with self.fs.open(self.fs_path(join_path(self.step_path(step), name)), "rb") as f:
                while chunk := f.read(8 << 20):
                    sha.update(chunk)
                    size += len(chunk)
            out[name] = {"bytes": size, "sha256": sha.hexdigest()}
        return out

    def commit(self, step: int, files: dict[str, dict]) -> None:
        """Write the commit marker, last: the size and checksum of every file in the step."""
        self._write_json(join_path(self.step_path(step), COMMIT), {"step": step, "files": files})

    def manifest(self, step: int) -> dict[str, dict]:
        """The commit marker's files; ValueError when it is not one (corrupt), OSError when unreadable."""
        with self.fs.open(self.fs_path(join_path(self.step_path(step), COMMIT))) as f:
            marker = json.load(f)
        files = marker.get("files") if isinstance(marker, dict) else None
        if not isinstance(files, dict) or not all(isinstance(meta, dict) for meta in files.values()):
            raise ValueError(f"{COMMIT} holds no file list")
        return files

    def mismatches(self, step: int, names: list[str]) -> list[str]:
        """The files among `names` that are missing or whose size or checksum differs from
        the commit marker. A file that exists but cannot be read raises `CheckpointUnreadable`."""
        expected = self.manifest(step)
        bad = []
        for name in names:
            try:
                if self.digest(step, [name])[name] != expected[name]:
                    bad.append(name)
            except FileNotFoundError:
                bad.append(name)
            except OSError as err:
                raise CheckpointUnreadable(f"{self.step_path(step)}/{name}: {err}") from err
        return bad

    def clear_after(self, step: int) -> dict[str, list[int]]:
        """Make way for steps after `step` to be written again (an old commit marker must
        not vouch for files being rewritten): a committed one (it failed its checks) is set
        aside under another name, a half-written one (no commit marker: this job's, under
        its lease) is removed. A file that merely has a step's name is left alone."""
        cleared: dict[str, list[int]] = {"set_aside": [], "removed": []}
        for path in self.fs.ls(self._fs_root, detail=False) if self.fs.exists(self._fs_root) else []:
            name = path.rstrip("/").rsplit("/", 1)[-1]
            m = STEP_DIR.match(name)
            if not (m and int(m.group(1)) > step and self.fs.isdir(path)):
                continue
            if self.fs.exists(join_path(path, COMMIT)):
                self._move_tree(path, self._aside_name(name))
                cleared["set_aside"].append(int(m.group(1)))
            else:
                self.fs.rm(path, recursive=True)
                cleared["removed"].append(int(m.group(1)))
        return cleared

    def remove_steps(self) -> list[int]:
        """Delete every step directory, committed or not (`checkpoint.discard_existing`: the user's explicit choice)."""
        removed = []
        for path in self.fs.ls(self._fs_root, detail=False) if self.fs.exists(self._fs_root) else []:
            m = STEP_DIR.match(path.rstrip("/").rsplit("/", 1)[-1])
            if m and self.fs.isdir(path):
                self.fs.rm(path, recursive=True)
                removed.append(int(m.group(1)))
        return sorted(removed)

    def _move_tree(self, source: str, target: str) -> None:
        """A rename on a filesystem; on an object store (no rename, no directories) each
        file is copied, then the originals removed."""
        if isinstance(self.fs, LocalFileSystem):
            self.fs.mv(source, target, recursive=True)
            return
        source = source.rstrip("/")
        for file in self.fs.find(source):
            self.fs.copy(file, target + file[len(source) :])
        self.fs.rm(source, recursive=True)

    def _aside_name(self, name: str) -> str:
        taken = {p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self._fs_root, detail=False)}
        candidate, n = SET_ASIDE + name, 1
        while candidate in taken:
            n += 1
            candidate = f"{SET_ASIDE}{name}.{n}"
        return join_path(self._fs_root, candidate)

    def prune(self, keep: int, keep_every: Optional[int] = None) -> list[int]:
        """Delete committed checkpoints but the newest `keep` and every `keep_every`-th
        step; returns the removed steps."""
        removed = [s for s in self.committed()[:-keep] if not (keep_every and s % keep_every == 0)]
        for step in removed:
            self.fs.rm(self.fs_path(self.step_path(step)), recursive=True)
        return removed
