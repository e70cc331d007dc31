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
import os
import json
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Optional, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from lmforge.engines.base import Engine

STATE = "state.json"


def rng_name(rank: int) -> str:
    return f"rng/rank_{rank:05d}.safetensors"


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


class _Kept(io.BytesIO):
    """A stream whose bytes are kept when it is closed."""

    def __init__(self, keep: Callable[[bytes], None]):
        super().__init__()
        self._keep = keep

    def close(self) -> None:
        if not self.closed:
            self._keep(self.getvalue())
        super().close()


def _writer(files: MemoryFiles) -> FileSystemWriter:
    writer = FileSystemWriter("", sync_files=False, overwrite=True)
    writer.fs = files
    return writer


def _reader(files: MemoryFiles) -> FileSystemReader:
    reader = FileSystemReader("")
    reader.fs = files
    return reader


class SnapshotWriter:
    def __init__(self, target: SnapshotTarget, group: dist.ProcessGroup):
        """`group`: a gloo group of its own; a storage checkpoint may be in flight on another."""
        self.target, self.group = target, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot")
        self._pending: Optional[Future] = None
        self._staging: Optional[Future] = None
        cuda = torch.cuda.is_available()
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=cuda, use_non_blocking_copy=cuda))

    def save(self, step: int, engine: Engine, trainer_state: dict) -> None:
        """Collective over every rank at the same step."""
        self.wait()
        tensors, plain = engine.state_dict()
        files = MemoryFiles()
        response = dcp.async_save(tensors, storage_writer=_writer(files), process_group=self.group, async_stager=self._stager)
        upload = getattr(response, "upload_completion", response)
        self._staging = getattr(response, "staging_completion", None)
        files.files[rng_name(self.rank)] = save_safetensors(_rng_state())
        if self.rank == 0:
            files.files[STATE] = json.dumps({**trainer_state, "engine": plain}).encode()
        self._pending = self._thread.submit(self._finish, step, upload, files)

    def staged(self) -> None:
        if self._staging is not None:
            staging, self._staging = self._staging, None
            staging.result()

    def wait(self) -> None:
        self.staged()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._thread.shutdown(wait=True)
            self._stager.close()

    def _finish(self, step: int, upload: Future, files: MemoryFiles) -> None:
        upload.result()
        self.target.put(step, self.rank, files.files)
        dist.barrier(group=self.group)  # every rank's files are kept
        if self.rank == 0:
            self.target.taken(step, self.world)


def snapshot_state(fetch: Callable[[str], bytes]) -> dict:
    return json.loads(fetch(STATE))


def load_snapshot(fetch: Callable[[str], bytes], engine: Engine, state: dict) -> None:
    """This rank's share of a snapshot, resharded to the engine's layout; `state`:
    its `state.json`."""
    tensors, _ = engine.state_dict()
    dcp.load(tensors, storage_reader=_reader(MemoryFiles(fetch)))
    engine.load_state_dict(tensors, state["engine"])
    try:
        rng = load_safetensors(fetch(rng_name(dist.get_rank())))
    except KeyError:
        return  # a rank that did not exist when the snapshot was taken keeps its seeded RNG
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def _rng_state() -> dict:
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng
