"""Which checkpoint counts: only committed steps, newest first, checksums, retention."""

import json

import pytest

from lmforge.checkpoint.store import CheckpointStore
from lmforge.errors import UserError


def _fake_step(store: CheckpointStore, step: int, commit: bool = True):
    path = store.fs_path(store.step_path(step))
    store.fs.makedirs(path, exist_ok=True)
    with store.fs.open(path + "/__0_0.distcp", "wb") as f:
        f.write(b"x" * step)
    store.write_state(step, {"step": step})
    if commit:
        store.commit(step, store.digest(step, store.files(step)))


def test_latest_ignores_uncommitted(tmp_path):
    store = CheckpointStore(str(tmp_path / "ck"))
    assert store.latest() is None
    _fake_step(store, 10)
    _fake_step(store, 20, commit=False)
    latest = store.latest()
    assert latest.step == 10 and latest.state == {"step": 10}


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


def test_discard_after_removes_newer_step_dirs_only(tmp_path):
    store = CheckpointStore(str(tmp_path))
    for step in (1, 2, 3):
        _fake_step(store, step, commit=step != 3)
    (tmp_path / "step_00000009").write_text("not ours")
    assert store.discard_after(1) == [2, 3]
    assert store.committed() == [1] and (tmp_path / "step_00000009").is_file()


def test_fsspec_uri_works_like_a_path(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}/uri")
    _fake_step(store, 3)
    assert store.latest().step == 3


def test_unusable_directory_is_a_user_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match="checkpoint.dir"):
        CheckpointStore(str(blocker / "ck")).check_usable()
