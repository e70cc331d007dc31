"""Which checkpoint counts: only committed steps, newest first, checksums, retention;
a read error told apart from corruption; corrupt steps set aside, never deleted."""

import json

import pytest

from lmforge.checkpoint.state import TrainerState
from lmforge.checkpoint.store import CheckpointStore, CheckpointUnreadable
from lmforge.errors import UserError


def _fake_step(store: CheckpointStore, step: int, commit: bool = True):
    path = store.fs_path(store.step_path(step))
    store.fs.makedirs(path, exist_ok=True)
    with store.fs.open(path + "/__0_0.distcp", "wb") as f:
        f.write(b"x" * step)
    store.write_state(step, TrainerState(step=step))
    if commit:
        store.commit(step, store.digest(step, store.files(step)))


def test_latest_ignores_uncommitted(tmp_path):
    store = CheckpointStore(str(tmp_path / "ck"))
    assert store.latest() is None
    _fake_step(store, 10)
    _fake_step(store, 20, commit=False)
    latest = store.latest()
    assert latest.step == 10 and latest.state == TrainerState(step=10)


def test_commit_records_sizes_and_checksums(tmp_path):
    store = CheckpointStore(str(tmp_path))
    _fake_step(store, 5)
    commit = json.loads((tmp_path / "step_00000005" / "commit.json").read_text())
    assert commit["files"]["__0_0.distcp"]["bytes"] == 5
    assert len(commit["files"]["state.json"]["sha256"]) == 64


def test_unreadable_state_falls_back_to_previous(tmp_path):
    store = CheckpointStore(str(tmp_path))
    _fake_step(store, 1)
    _fake_step(store, 2)
    (tmp_path / "step_00000002" / "state.json").write_text("{not json")
    assert store.latest().step == 1


def test_prune_keeps_newest(tmp_path):
    store = CheckpointStore(str(tmp_path))
    for step in (1, 2, 3, 4):
        _fake_step(store, step)
    assert store.prune(keep=2) == [1, 2]
    assert store.committed() == [3, 4]


def test_prune_keeps_every_mth_step_too(tmp_path):
    store = CheckpointStore(str(tmp_path))
    for step in (2, 4, 6, 8, 10, 12):
        _fake_step(store, step)
    assert store.prune(keep=2, keep_every=4) == [2, 6]
    assert store.committed() == [4, 8, 10, 12]


def test_a_flipped_byte_is_a_mismatch(tmp_path):
    store = CheckpointStore(str(tmp_path))
    _fake_step(store, 7)
    names = sorted(store.manifest(7))
    assert names == ["__0_0.distcp", "state.json"] and store.mismatches(7, names) == []
    shard = tmp_path / "step_00000007" / "__0_0.distcp"
    shard.write_bytes(b"y" + shard.read_bytes()[1:])  # same size, other content
    assert store.mismatches(7, names) == ["__0_0.distcp"]
    shard.unlink()
    assert store.mismatches(7, names) == ["__0_0.distcp"]


def test_clearing_after_a_step_sets_committed_ones_aside_and_removes_half_written_ones(tmp_path):
    store = CheckpointStore(str(tmp_path))
    for step in (1, 2, 3):
        _fake_step(store, step, commit=step != 3)
    (tmp_path / "step_00000009").write_text("not ours")
    assert store.clear_after(1) == {"set_aside": [2], "removed": [3]}
    assert store.committed() == [1] and (tmp_path / "step_00000009").is_file()
    assert (tmp_path / "corrupt_step_00000002" / "__0_0.distcp").read_bytes() == b"xx"  # kept for a look, never loaded
    _fake_step(store, 2)
    assert store.clear_after(1)["set_aside"] == [2] and (tmp_path / "corrupt_step_00000002.2").is_dir()


def test_a_read_error_is_not_corruption(tmp_path, monkeypatch):
    """Storage that fails to read says nothing about the files: no mismatch is claimed."""
    store = CheckpointStore(str(tmp_path))
    _fake_step(store, 4)
    names = sorted(store.manifest(4))
    real_open = store.fs.open

    def failing_open(path, mode="rb", **kwargs):
        if path.endswith(".distcp"):
            raise OSError(5, "Input/output error")
        return real_open(path, mode, **kwargs)

    monkeypatch.setattr(store.fs, "open", failing_open)
    with pytest.raises(CheckpointUnreadable, match="Input/output error"):
        store.mismatches(4, names)


def test_commit_and_state_are_written_whole(tmp_path, monkeypatch):
    """A write that fails midway leaves the previous file (or none), never half of one."""
    import os

    store = CheckpointStore(str(tmp_path))
    _fake_step(store, 6)
    before = (tmp_path / "step_00000006" / "commit.json").read_text()

    def failing_replace(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space"):
        store.commit(6, {"__0_0.distcp": {"bytes": 0, "sha256": "0"}})
    assert (tmp_path / "step_00000006" / "commit.json").read_text() == before


def test_fsspec_uri_works_like_a_path(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}/uri")
    _fake_step(store, 3)
    assert store.latest().step == 3


def test_unusable_directory_is_a_user_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match="checkpoint.dir"):
        CheckpointStore(str(blocker / "ck")).check_usable()


def test_a_fresh_start_discards_checkpoints_only_when_told(tmp_path):
    """`checkpoint.resume: false` over committed checkpoints: refused, unless
    `discard_existing` says to delete them (then every step directory goes, and
    nothing else)."""
    from conftest import tiny_job
    from lmforge.cluster.driver import _start_over
    from lmforge.console import text_console
    from lmforge.spec import spec_from_dict

    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    store = CheckpointStore(str(checkpoints))
    for step in (4, 8):
        _fake_step(store, step)
    (checkpoints / "notes.txt").write_text("mine")
    fresh = spec_from_dict(tiny_job(tmp_path, tmp_path / "data", checkpoint={"resume": False}))
    with pytest.raises(UserError, match="holds 2 committed checkpoints .steps 4..8. and checkpoint.resume is false"):
        _start_over(fresh, text_console())
    assert store.committed() == [4, 8]
    _start_over(spec_from_dict(tiny_job(tmp_path, tmp_path / "data", checkpoint={"resume": False, "discard_existing": True})), text_console())
    assert store.committed() == [] and sorted(p.name for p in checkpoints.iterdir()) == ["notes.txt"]
