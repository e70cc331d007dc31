"""Save and restore one rank's share of a checkpoint with torch.distributed.checkpoint.

Every rank writes its own shards; rank 0 writes the JSON state and then commits.
DCP reshards on load, so a checkpoint saved on N ranks loads on M. An engine with
its own format (DeepSpeed) writes its files into the same step directory, under
the same commit rule.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from lmforge.checkpoint.store import CheckpointStore, CommittedCheckpoint, join_path
from lmforge.engines.base import Engine


def _writer(store: CheckpointStore, path: str):
    return FsspecWriter(path) if store.is_uri else dcp.FileSystemWriter(store.fs_path(path))


def _reader(store: CheckpointStore, path: str):
    return FsspecReader(path) if store.is_uri else dcp.FileSystemReader(store.fs_path(path))


def _rng_file(path: str, rank: int) -> str:
    return join_path(path, "rng", f"rank_{rank:05d}.safetensors")


def save_checkpoint(store: CheckpointStore, step: int, engine: Engine, trainer_state: dict, keep: int) -> list[int]:
    """Collective: every rank calls it at the same step. Returns pruned steps (rank 0)."""
    path = store.step_path(step)
    plain: dict = {}
    if engine.checkpoint_format == "dcp":
        tensors, plain = engine.state_dict()
        dcp.save(tensors, storage_writer=_writer(store, path))
    else:
        engine.save(store.fs_path(path))
    rank = dist.get_rank()
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    store.fs.makedirs(store.fs_path(join_path(path, "rng")), exist_ok=True)
    with store.fs.open(store.fs_path(_rng_file(path, rank)), "wb") as f:
        f.write(save_safetensors(rng))
    dist.barrier()
    pruned: list[int] = []
    if rank == 0:
        store.write_state(step, {**trainer_state, "engine": plain, "format": engine.checkpoint_format})
        store.commit(step)
        pruned = store.prune(keep)
    dist.barrier()
    return pruned


def load_checkpoint(store: CheckpointStore, ckpt: CommittedCheckpoint, engine: Engine) -> None:
    if engine.checkpoint_format == "dcp":
        tensors, _ = engine.state_dict()
        dcp.load(tensors, storage_reader=_reader(store, ckpt.path))
        engine.load_state_dict(tensors, ckpt.state["engine"])
    else:
        engine.load(store.fs_path(ckpt.path), ckpt.state)
    rng_path = store.fs_path(_rng_file(ckpt.path, dist.get_rank()))
    # A rank that did not exist when the checkpoint was saved keeps its seeded RNG.
    if store.fs.exists(rng_path):
        with store.fs.open(rng_path, "rb") as f:
            rng = load_safetensors(f.read())
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
