"""`lmforge export` checks a checkpoint's files against commit.json before anything
is read: DeepSpeed's pickles, DCP's metadata and shards (a flipped byte)."""

import json

import pytest

from cli import run_cli
from hf_models import word_level_tokenizer
from lmforge.checkpoint.deepspeed_files import CHECKPOINT_TAG
from lmforge.checkpoint.export import export_model
from lmforge.checkpoint.state import TrainerState
from lmforge.checkpoint.store import CheckpointStore
from lmforge.errors import UserError
from lmforge.models.config import PRESETS
from ports import free_port


def test_a_tampered_deepspeed_file_is_refused_before_unpickling(tmp_path, caplog):
    store = CheckpointStore(str(tmp_path))
    step_dir = tmp_path / "step_00000003"
    (step_dir / CHECKPOINT_TAG).mkdir(parents=True)
    pickle = step_dir / CHECKPOINT_TAG / "mp_rank_00_model_states.pt"
    pickle.write_bytes(b"not a pickle, and never to be read as one")
    store.write_state(3, TrainerState(step=3, format="deepspeed", model=PRESETS["tiny"].as_dict()))
    store.commit(3, store.digest(3, store.files(3)))
    pickle.write_bytes(b"X" + pickle.read_bytes()[1:])
    with (
        caplog.at_level("WARNING"),
        pytest.raises(UserError, match="mp_rank_00_model_states.pt: does not match its checksum in commit.json; refusing to read the checkpoint"),
    ):
        export_model(step_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert json.loads((step_dir / "state.json").read_text())["step"] == 3
    assert "is a DeepSpeed checkpoint, whose files Python unpickles (they can run code)" in caplog.text  # said before anything is read


def test_a_flipped_byte_in_a_native_checkpoint_is_refused_before_export(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    from lmforge.models import Transformer

    cfg = PRESETS["tiny"]
    store = CheckpointStore(str(tmp_path))
    step_dir = tmp_path / "step_00000005"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": Transformer(cfg).state_dict()}, checkpoint_id=str(step_dir), no_dist=True)
    # The run it names has a store nobody answers at: an export must not try it unless asked (--register).
    mlflow = {"tracking_uri": f"http://127.0.0.1:{free_port()}", "run_id": "0" * 32}
    store.write_state(5, TrainerState(step=5, format="dcp", model=cfg.as_dict(), engine={}, job="tiny", mlflow=mlflow))
    store.commit(5, store.digest(5, store.files(5)))
    exported = run_cli(
        "export", str(step_dir), "--out", str(tmp_path / "good"), "--tokenizer", str(word_level_tokenizer(tmp_path / "t.json", 10)), cwd=tmp_path
    )
    assert exported.returncode == 0 and "registered" not in exported.stderr, exported.stderr  # as committed: exported
    shard = sorted(step_dir.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match=f"{shard.name}: does not match its checksum in commit.json"):
        export_model(step_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


class _Payload:
    """What a crafted checkpoint's .metadata would hold: a call run as it is unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_crafted_checkpoint_index_is_refused_without_running_it(tmp_path):
    """An attacker who writes a checkpoint writes its commit.json too: the checksums
    match, and the index (DCP's pickled .metadata) must still not run code."""
    import pickle

    store = CheckpointStore(str(tmp_path))
    step_dir = tmp_path / "step_00000002"
    step_dir.mkdir()
    marker = tmp_path / "payload-ran"
    (step_dir / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    store.write_state(2, TrainerState(step=2, format="dcp", model=PRESETS["tiny"].as_dict(), engine={}))
    store.commit(2, store.digest(2, store.files(2)))
    with pytest.raises(UserError, match=r"\.metadata: refused to unpickle it: io.open is not part of a checkpoint's metadata"):
        export_model(step_dir, tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()
