"""Restore one rank's share of a checkpoint with torch.distributed.checkpoint, and
the pieces every save needs (the DCP writer, per-rank RNG files).

Every rank writes its own shards (see `writer.py`); DCP reshards on load, so a
checkpoint saved on N ranks loads on M. An engine with its own format (DeepSpeed)
keeps its files in the same step directory, under the same commit rule. Before a
checkpoint is loaded, the ranks check its files against the commit marker together;
a corrupt one is skipped for the one before it.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from lmforge.checkpoint.safe_metadata import SafeFileSystemReader, SafeFsspecReader
from lmforge.checkpoint.stateful import Checkpointable
from lmforge.checkpoint.store import CheckpointStore, CheckpointUnreadable, CommittedCheckpoint, join_path
from lmforge.events import CheckpointCorrupt, Event

log = logging.getLogger(__name__)


def dcp_writer(store: CheckpointStore, path: str):
    return FsspecWriter(path) if store.is_uri else dcp.FileSystemWriter(store.fs_path(path))


def _reader(store: CheckpointStore, path: str):
    return SafeFsspecReader(path) if store.is_uri else SafeFileSystemReader(store.fs_path(path))


def rng_name(rank: int) -> str:
    """A rank's RNG file within a checkpoint (or a snapshot)."""
    return f"rng/rank_{rank:05d}.safetensors"


def _rng_file(path: str, rank: int) -> str:
    return join_path(path, rng_name(rank))


def write_rng(store: CheckpointStore, path: str, rank: int, rng: dict[str, torch.Tensor]) -> None:
    store.fs.makedirs(store.fs_path(join_path(path, "rng")), exist_ok=True)
    with store.fs.open(store.fs_path(_rng_file(path, rank)), "wb") as f:
        f.write(save_safetensors(rng))


def restore_point(store: CheckpointStore, group: dist.ProcessGroup, report: Callable[[Event], None]) -> Optional[CommittedCheckpoint]:
    """Collective: the newest committed checkpoint whose files all match their commit
    marker (each rank checks a share). A corrupt one is reported and passed over; one
    that some rank could not read fails the attempt on every rank (`CheckpointUnreadable`),
    since a read error says nothing about the files."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for step in reversed(store.committed()):
        unreadable, mine = None, []
        try:
            names = sorted(store.manifest(step))
            mine = store.mismatches(step, names[rank::world])
        except CheckpointUnreadable as err:
            unreadable = str(err)
        except FileNotFoundError as err:
            mine = [f"commit.json ({err})"]
        except OSError as err:
            unreadable = f"{store.step_path(step)}/commit.json: {err}"
        except (ValueError, KeyError) as err:
            mine = [f"commit.json ({err})"]
        everyone: list = [None] * world
        dist.all_gather_object(everyone, (mine, unreadable), group=group)
        failed_reads = [read for _, read in everyone if read]
        if failed_reads:
            raise CheckpointUnreadable(f"could not read checkpoint {store.step_path(step)} ({failed_reads[0]}); nothing was changed")
        bad = sorted(name for part, _ in everyone for name in part)
        ckpt = None if bad else store.checkpoint(step)
        if ckpt is not None:
            return ckpt
        reason = f"{', '.join(bad[:3])} do not match commit.json" if bad else "state.json is unreadable"
        log.warning("checkpoint %s is corrupt (%s); trying the previous one", store.step_path(step), reason)
        if rank == 0:
            report(CheckpointCorrupt(step=step, path=store.step_path(step), reason=reason))
    return None


def load_checkpoint(store: CheckpointStore, ckpt: CommittedCheckpoint, engine: Checkpointable) -> None:
    if engine.checkpoint_format == "dcp":
        tensors, _ = engine.state_dict()
        dcp.load(tensors, storage_reader=_reader(store, ckpt.path))
        engine.load_state_dict(tensors, ckpt.state.engine)
    else:
        engine.load(store.fs_path(ckpt.path), ckpt.state)
    rng_path = store.fs_path(_rng_file(ckpt.path, dist.get_rank()))
    # A rank that did not exist when the checkpoint was saved keeps its seeded RNG.
    if store.fs.exists(rng_path):
        with store.fs.open(rng_path, "rb") as f:
            set_rng_state(load_safetensors(f.read()))


def rng_state() -> dict[str, torch.Tensor]:
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng


def set_rng_state(rng: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
