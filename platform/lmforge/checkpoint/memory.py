"""Checkpoints in host memory (`checkpoint.in_memory`): the same DCP files a storage
checkpoint has, written into memory instead of a directory and handed to keepers
on two nodes, so a restore after a failure reads no storage at all.

`SnapshotWriter` takes a snapshot every `checkpoint.memory_interval` steps like
`CheckpointWriter` takes a checkpoint: the state is copied synchronously, then a
thread serializes it, ships this rank's files and agrees with every rank that all
shipped. `load_snapshot` restores from those files on any layout (DCP reshards), each
rank fetching only the files its shards are in. Where the files go and come from
is a `SnapshotTarget`, so this module knows nothing of Ray's actors.
"""

from __future__ import annotations

import io
import json
import os
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Callable, Optional, Protocol

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemWriter

from lmforge.checkpoint.safe_metadata import SafeFileSystemReader
from lmforge.checkpoint.sharded import rng_name, rng_state, set_rng_state
from lmforge.checkpoint.state import TrainerState
from lmforge.checkpoint.stateful import Checkpointable
from lmforge.checkpoint.store import STATE
from lmforge.checkpoint.writer import BackgroundSaver


class SnapshotTarget(Protocol):
    def put(self, step: int, rank: int, files: dict[str, bytes]) -> None:
        """Keep this rank's files of `step` (on its own node and one other)."""

    def taken(self, step: int, world: int) -> None:
        """Every rank's files of `step` are kept (called on rank 0)."""


class MemoryFiles(FileSystemBase):
    """A file system DCP writes into and reads from: bytes by name. Files to read
    come from `fetch` when first opened, so a rank only pulls what it loads."""

    def __init__(self, fetch: Optional[Callable[[str], bytes]] = None):
        self.files: dict[str, bytes] = {}
        self.fetch = fetch

    @contextmanager
    def create_stream(self, path, mode: str):
        name = _name(path)
        if "w" in mode:
            stream = _Kept(lambda data: self.files.__setitem__(name, data))
            yield stream
            stream.close()  # DCP closes its streams itself, or not
            return
        if name not in self.files:
            if self.fetch is None:
                raise FileNotFoundError(name)
            self.files[name] = self.fetch(name)
        yield io.BytesIO(self.files[name])

    def concat_path(self, path, suffix: str) -> str:
        return f"{path}/{suffix}" if str(path) else suffix

    def init_path(self, path) -> str:
        return ""  # names are relative to the snapshot: `.metadata`, `__0_0.distcp`

    def rename(self, path, new_path) -> None:
        self.files[_name(new_path)] = self.files.pop(_name(path))

    def mkdir(self, path) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def exists(self, path) -> bool:
        return _name(path) in self.files

    def rm_file(self, path) -> None:
        self.files.pop(_name(path), None)


def _name(path) -> str:
    """Names relative to the snapshot, as DCP's metadata has them (it may prefix `./`)."""
    return os.path.normpath(str(path))


class _Kept(io.RawIOBase):
    """A write-only stream whose bytes are kept, joined once, when it is closed. Its
    chunks are collected rather than appended to one buffer: a growing buffer copies
    what it holds at each resize, and every copy holds the GIL against training."""

    def __init__(self, keep: Callable[[bytes], None]):
        super().__init__()
        self._keep, self._chunks, self._size = keep, [], 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._size  # DCP records each item's offset

    def write(self, data) -> int:
        self._chunks.append(bytes(data))  # DCP's stager reuses its buffers: copy
        self._size += len(self._chunks[-1])
        return len(self._chunks[-1])

    def close(self) -> None:
        if not self.closed:
            self._keep(b"".join(self._chunks))
            self._chunks = []
        super().close()


def _writer(files: MemoryFiles) -> FileSystemWriter:
    writer = FileSystemWriter("", sync_files=False, overwrite=True)
    writer.fs = files
    return writer


def _reader(files: MemoryFiles) -> SafeFileSystemReader:
    reader = SafeFileSystemReader("")
    reader.fs = files
    return reader


class SnapshotWriter(BackgroundSaver):
    def __init__(self, target: SnapshotTarget, group: dist.ProcessGroup):
        """`group`: a gloo group of its own; a storage checkpoint may be in flight on another."""
        super().__init__(group, "snapshot")
        self.target = target

    def save(self, step: int, engine: Checkpointable, trainer_state: TrainerState) -> None:
        """Collective over every rank at the same step."""
        self.wait()
        tensors, plain = engine.state_dict()
        files = MemoryFiles()
        upload = self._async_save(tensors, _writer(files))
        files.files[rng_name(self.rank)] = save_safetensors(rng_state())
        if self.rank == 0:
            files.files[STATE] = json.dumps(trainer_state.model_copy(update={"engine": plain}).as_json()).encode()
        self._pending = self._thread.submit(self._finish, step, upload, files)

    def _finish(self, step: int, upload: Future, files: MemoryFiles) -> None:
        upload.result()
        self.target.put(step, self.rank, files.files)
        dist.barrier(group=self.group)  # every rank's files are kept
        if self.rank == 0:
            self.target.taken(step, self.world)


def snapshot_state(fetch: Callable[[str], bytes]) -> TrainerState:
    return TrainerState.model_validate_json(fetch(STATE))


def load_snapshot(fetch: Callable[[str], bytes], engine: Checkpointable, state: TrainerState) -> None:
    """This rank's share of a snapshot, resharded to the engine's layout; `state`:
    its `state.json`."""
    tensors, _ = engine.state_dict()
    dcp.load(tensors, storage_reader=_reader(MemoryFiles(fetch)))
    engine.load_state_dict(tensors, state.engine)
    try:
        rng = fetch(rng_name(dist.get_rank()))
    except KeyError:
        return  # a rank that did not exist when the snapshot was taken keeps its seeded RNG
    set_rng_state(load_safetensors(rng))
