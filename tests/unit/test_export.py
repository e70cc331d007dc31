"""`lmforge export` checks a DeepSpeed checkpoint's files against commit.json before
anything is unpickled."""

import json

import pytest

from lmforge.checkpoint.export import export_model
from lmforge.checkpoint.store import CheckpointStore
from lmforge.engines.deepspeed import CHECKPOINT_TAG
from lmforge.errors import UserError
from lmforge.models.config import PRESETS


def test_a_tampered_deepspeed_file_is_refused_before_unpickling(tmp_path):
    store = CheckpointStore(str(tmp_path))
    step_dir = tmp_path / "step_00000003"
    (step_dir / CHECKPOINT_TAG).mkdir(parents=True)
    pickle = step_dir / CHECKPOINT_TAG / "mp_rank_00_model_states.pt"
    pickle.write_bytes(b"not a pickle, and never to be read as one")
    store.write_state(3, {"step": 3, "format": "deepspeed", "model": PRESETS["tiny"].as_dict()})
    store.commit(3, store.digest(3, store.files(3)))
    pickle.write_bytes(b"X" + pickle.read_bytes()[1:])
    with pytest.raises(UserError, match="mp_rank_00_model_states.pt: does not match its checksum in commit.json; refusing to unpickle it"):
        export_model(step_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert json.loads((step_dir / "state.json").read_text())["step"] == 3
