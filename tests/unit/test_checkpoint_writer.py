"""The background checkpoint writer on one gloo rank: a save commits with checksums
while the caller goes on, its copy is taken at save time, failed writes are counted
and tolerated up to `max_failed_writes`, and retention keeps every M-th step."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lmforge.checkpoint.config import CheckpointSpec
from lmforge.checkpoint.memory import SnapshotWriter, load_snapshot, snapshot_state
from lmforge.checkpoint.sharded import load_checkpoint, restore_point
from lmforge.checkpoint.state import TrainerState
from lmforge.checkpoint.store import CheckpointStore
from lmforge.checkpoint.writer import CheckpointWriter
from lmforge.engines.base import Engine
from lmforge.errors import CheckpointWritesFailing


class OneTensor(Engine):
    """The smallest engine: one weight vector, so the test sees what was saved."""

    def __init__(self):
        self.weight = torch.zeros(1000)

    def train_step(self, micro_batches, before_update=lambda: None):
        before_update()
        self.weight += 1

    def state_dict(self):
        return {"model": {"weight": self.weight}}, {"scheduler": {}}

    def load_state_dict(self, tensors, plain):
        self.weight.copy_(tensors["model"]["weight"])


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def _writer(root, group, events, **options):
    return CheckpointWriter(CheckpointStore(str(root)), CheckpointSpec(**options), group, events.append)


def test_a_save_commits_the_state_as_it_was_at_save_time(tmp_path, group):
    engine, events = OneTensor(), []
    writer = _writer(tmp_path, group, events)
    engine.train_step(None)
    writer.save(1, engine, TrainerState(step=1))
    engine.train_step(None, before_update=writer.staged)  # changes the weight while the write may still run
    writer.close()
    (event,) = events
    assert event.event == "checkpoint" and event.step == 1 and event.stall_seconds <= event.seconds
    store = CheckpointStore(str(tmp_path))
    assert store.committed() == [1] and store.mismatches(1, sorted(store.manifest(1))) == []
    assert json.loads((tmp_path / "step_00000001" / "state.json").read_text())["format"] == "dcp"
    loaded = {"model": {"weight": torch.empty(1000)}}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "step_00000001"), no_dist=True)
    assert torch.equal(loaded["model"]["weight"], torch.ones(1000)) and torch.equal(engine.weight, torch.full((1000,), 2.0))


def test_failed_writes_are_reported_until_too_many_in_a_row(tmp_path, group):
    engine, events = OneTensor(), []
    writer = _writer(tmp_path, group, events, max_failed_writes=2)
    for step in (2, 3):
        (tmp_path / f"step_{step:08d}").write_text("in the way")  # a file where the step's directory goes
    writer.save(1, engine, TrainerState(step=1))
    writer.save(2, engine, TrainerState(step=2))
    writer.save(4, engine, TrainerState(step=4))  # waits for 2 (failed: 1 in a row), then writes 4
    writer.save(3, engine, TrainerState(step=3))  # waits for 4 (committed: the count resets)
    writer.wait()  # 3 failed: 1 in a row, still tolerated
    assert [(e.event, e.step) for e in events] == [("checkpoint", 1), ("checkpoint_failed", 2), ("checkpoint", 4), ("checkpoint_failed", 3)]
    assert "step_00000002" in events[1].error and events[1].failed_in_a_row == 1
    (tmp_path / "step_00000005").write_text("in the way")
    writer.save(5, engine, TrainerState(step=5))
    with pytest.raises(CheckpointWritesFailing, match="2 checkpoints in a row could not be written"):
        writer.close()


def test_retention_keeps_the_newest_and_every_mth(tmp_path, group):
    engine, events = OneTensor(), []
    writer = _writer(tmp_path, group, events, keep=2, keep_every=4)
    for step in range(1, 9):
        writer.save(step, engine, TrainerState(step=step))
    writer.close()
    assert CheckpointStore(str(tmp_path)).committed() == [4, 7, 8]


def test_an_fsspec_uri_saves_verifies_and_restores(group):
    """DCP's fsspec writer and reader, through an in-memory filesystem (one process)."""
    engine, events = OneTensor(), []
    root = "memory://lmforge-test/ck"
    writer = _writer(root, group, events)
    for step in (1, 2):
        engine.train_step(None, before_update=writer.staged)
        writer.save(step, engine, TrainerState(step=step))
    writer.close()
    store = CheckpointStore(root)
    assert store.is_uri and store.committed() == [1, 2]
    with store.fs.open(store.fs_path(root + "/step_00000002/rng/rank_00000.safetensors"), "wb") as f:
        f.write(b"not what was committed")
    reported = []
    ckpt = restore_point(store, group, reported.append)
    assert ckpt.step == 1 and [e.step for e in reported] == [2] and "rng/rank_00000.safetensors" in reported[0].reason
    restored = OneTensor()
    load_checkpoint(store, ckpt, restored)
    assert torch.equal(restored.weight, torch.ones(1000))


class DictTarget:
    """Keeps snapshots in this process, as the keepers keep them across nodes."""

    def __init__(self):
        self.files, self.taken_steps = {}, []

    def put(self, step, rank, files):
        self.files[step] = dict(files)

    def taken(self, step, world):
        self.taken_steps.append((step, world))


def test_a_memory_snapshot_is_a_dcp_checkpoint_restored_as_it_was_at_save_time(tmp_path, group):
    engine, target = OneTensor(), DictTarget()
    snapshots = SnapshotWriter(target, group)
    engine.train_step(None)
    snapshots.save(1, engine, TrainerState(step=1))
    engine.train_step(None, before_update=snapshots.staged)
    snapshots.close()
    assert target.taken_steps == [(1, 1)]
    files = target.files[1]
    assert (
        json.loads(files["state.json"]) == {"step": 1, "engine": {"scheduler": {}}, "order": {}, "records": [], "format": "dcp"}
        and ".metadata" in files
    )
    fetched = []
    fetch = lambda name: fetched.append(name) or files[name]
    restored = OneTensor()
    load_snapshot(fetch, restored, snapshot_state(fetch))
    assert torch.equal(restored.weight, torch.ones(1000)) and engine.weight[0] == 2
    # The same files on disk are an ordinary DCP checkpoint.
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    state = {"model": {"weight": torch.zeros(1000)}}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(tmp_path)))
    assert torch.equal(state["model"]["weight"], torch.ones(1000))


def test_a_restore_point_tells_a_read_error_from_corruption(tmp_path, group, monkeypatch):
    """Corrupt (read, and did not match): reported and passed over for the step before.
    Unreadable (the storage failed): the attempt fails, and every file stays."""
    from lmforge.checkpoint.store import CheckpointUnreadable

    engine, events = OneTensor(), []
    writer = _writer(tmp_path, group, events, async_save=False)
    for step in (1, 2):
        engine.train_step(None)
        writer.save(step, engine, TrainerState(step=step))
    writer.close()
    store = CheckpointStore(str(tmp_path))
    shard = sorted((tmp_path / "step_00000002").glob("*.distcp"))[0]
    real_open = store.fs.open
    monkeypatch.setattr(
        store.fs,
        "open",
        lambda path, *a, **k: (_ for _ in ()).throw(OSError(5, "Input/output error")) if path.endswith(".distcp") else real_open(path, *a, **k),
    )
    reported = []
    with pytest.raises(CheckpointUnreadable, match="could not read checkpoint .*step_00000002.*Input/output error"):
        restore_point(store, group, reported.append)
    assert not reported and store.committed() == [1, 2]
    monkeypatch.setattr(store.fs, "open", real_open)
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert restore_point(store, group, reported.append).step == 1
    assert [event.step for event in reported] == [2]
    assert store.clear_after(1) == {"set_aside": [2], "removed": []} and (tmp_path / "corrupt_step_00000002" / shard.name).exists()
