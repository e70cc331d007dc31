"""The deepspeed section: a DeepSpeed config reconciled with the job, every
contradiction one line naming the setting."""

import json

import pytest

from conftest import REPO
from lmforge.errors import UserError
from lmforge.spec import load_spec, spec_from_dict

DOC_CONFIG = {
    "train_batch_size": 4096,
    "optimizer": {"type": "AdamW", "params": {"lr": 6e-5}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
}


def ds_job(config=None, **sections):
    job = {"name": "t", "data": {"path": "d"}, "engine": "deepspeed", "deepspeed": {"config": config or {}}, "parallel": {"dp": 2}}
    job.update(sections)
    return job


def test_the_documentation_config_is_shipped_exactly():
    assert json.loads((REPO / "jobs" / "zero3-offload.json").read_text()) == DOC_CONFIG


def test_job_file_reads_the_config_relative_to_itself_and_fills_it_in():
    spec = load_spec(REPO / "jobs" / "zero3-offload.yaml")
    config = spec.deepspeed.config
    assert spec.deepspeed.config_file == str(REPO / "jobs" / "zero3-offload.json")
    # The config's values become the job's ...
    assert spec.train.global_batch == 4096 and spec.optim.lr == 6e-5
    # ... and the job fills in what DeepSpeed needs.
    assert config["train_micro_batch_size_per_gpu"] == spec.train.micro_batch == 8
    assert config["gradient_accumulation_steps"] == spec.grad_accum == 4096 // (8 * 2)
    assert config["bf16"] == {"enabled": False} and config["fp16"] == {"enabled": False}
    assert config["gradient_clipping"] == spec.optim.grad_clip
    assert config["optimizer"]["params"]["torch_adam"] is True
    assert config["zero_optimization"] == DOC_CONFIG["zero_optimization"]


def test_overrides_reach_into_a_config_file():
    spec = load_spec(REPO / "jobs" / "zero3-offload.yaml", ["deepspeed.config.train_batch_size=16"])
    assert spec.train.global_batch == 16 and spec.deepspeed.config["gradient_accumulation_steps"] == 1


def test_reconciled_spec_validates_again_unchanged():
    spec = load_spec(REPO / "jobs" / "zero3-offload.yaml")
    again = spec_from_dict(spec.model_dump(mode="json", exclude_unset=True))
    assert again == spec


def test_two_of_three_batch_settings_fix_the_third():
    spec = spec_from_dict(ds_job({"train_batch_size": 32, "gradient_accumulation_steps": 4}))
    assert spec.train.micro_batch == 4 and spec.deepspeed.config["train_micro_batch_size_per_gpu"] == 4


def test_precision_from_the_config_and_auto_values():
    spec = spec_from_dict(ds_job({"bf16": {"enabled": True}, "train_batch_size": "auto"}))
    assert spec.train.precision == "bf16" and spec.deepspeed.config["train_batch_size"] == spec.train.global_batch


@pytest.mark.parametrize(
    "config, sections, message",
    [
        ({"train_batch_size": 4096}, {"train": {"global_batch": 8}}, "deepspeed.config.train_batch_size: 4096 contradicts train.global_batch 8"),
        (
            {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
            {},
            "deepspeed.config.train_batch_size: 16 != train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 3 x dp 2",
        ),
        ({"bf16": {"enabled": True}}, {"train": {"precision": "fp32"}}, "its fp16/bf16 sections mean bf16, train.precision is fp32"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, {}, "fp16 and bf16 are both enabled"),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 6e-5}}},
            {"optim": {"lr": 1e-3}},
            "deepspeed.config.optimizer.params.lr: 6e-05 contradicts optim.lr 0.001",
        ),
        ({"gradient_clipping": 0.5}, {"optim": {"grad_clip": 2.0}}, "deepspeed.config.gradient_clipping: 0.5 contradicts optim.grad_clip 2.0"),
        (
            {"zero_optimisation": {"stage": 3}},
            {},
            "deepspeed.config.zero_optimisation: not a DeepSpeed setting (DeepSpeed would ignore it silently); did you mean zero_optimization?",
        ),
        ({"zero_optimization": {"stage": 4}}, {}, "deepspeed.config.zero_optimization.stage: unknown stage 4"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}, {}, "offload_param.device: 'gpu' is not one of cpu, nvme, none"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, {}, "offload_param.nvme_path: offloading to nvme needs a path"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, {}, "offload_param: needs stage 3, not 2"),
        ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, {}, "offload_optimizer: needs stage 1 or 2 or 3, not 0"),
        ({}, {"parallel": {"dp": 2, "zero": 2}}, "parallel.zero: a native-engine setting"),
        ({}, {"parallel": {"dp": 2, "compile": True}}, "parallel.compile: the deepspeed engine does not compile the model"),
        (
            {"activation_checkpointing": {"partition_activations": True}},
            {},
            "deepspeed.config.activation_checkpointing: not applied by lmforge (works only in a model that calls deepspeed.checkpointing; "
            "set parallel.activation_checkpointing)",
        ),
        ({"compile": {"deepcompile": True}}, {}, "deepspeed.config.compile: not applied by lmforge (lmforge does not call"),
        ({"tensor_parallel": {"autotp_size": 2}}, {}, "deepspeed.config.tensor_parallel: not applied by lmforge (AutoTP would shard"),
        ({"pipeline": {"partition": "parameters"}}, {}, "deepspeed.config.pipeline: not applied by lmforge"),
        ({"elasticity": {"enabled": True, "max_train_batch_size": 64}}, {}, "deepspeed.config.elasticity: not applied by lmforge"),
        ({"sequence_parallel_size": 2}, {}, "deepspeed.config.sequence_parallel_size: not applied by lmforge"),
        ({}, {"parallel": {"dp": 1, "tp": 2}}, "parallel.tp: the deepspeed engine runs data parallelism only"),
    ],
)
def test_contradictions_name_the_setting(config, sections, message):
    with pytest.raises(UserError) as err:
        spec_from_dict(ds_job(config, **sections))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_sections_lmforge_does_not_apply_are_accepted_when_off():
    off = {"elasticity": {"enabled": False, "max_train_batch_size": 64}, "sequence_parallel_size": 1, "dataloader_drop_last": False}
    off |= {"activation_checkpointing": {"partition_activations": False, "number_checkpoints": None}, "tensor_parallel": {"autotp_size": 1}}
    assert spec_from_dict(ds_job(off)).deepspeed.config["elasticity"]["enabled"] is False


def test_engine_and_section_must_agree():
    with pytest.raises(UserError, match="deepspeed: engine: deepspeed needs a deepspeed.config"):
        spec_from_dict({"name": "t", "data": {"path": "d"}, "engine": "deepspeed"})
    with pytest.raises(UserError, match="deepspeed: set engine: deepspeed"):
        spec_from_dict({"name": "t", "data": {"path": "d"}, "deepspeed": {"config": {}}})
    assert (
        spec_from_dict({"name": "t", "data": {"path": "d"}, "train": {"precision": "fp16"}}).train.precision == "fp16"
    )  # native: its own loss scale


def test_config_file_errors_name_the_file(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    job = {"name": "t", "data": {"path": "d"}, "engine": "deepspeed", "deepspeed": {"config": "bad.json"}}
    with pytest.raises(UserError, match=r"deepspeed.config: .*bad.json: not valid JSON \(line 1"):
        spec_from_dict(job, base_dir=tmp_path)
    job["deepspeed"]["config"] = "missing.json"
    with pytest.raises(UserError, match=r"deepspeed.config: .*missing.json: unreadable"):
        spec_from_dict(job, base_dir=tmp_path)


def test_every_known_key_is_one_deepspeed_reads():
    """Guards the unknown-key check itself: no key lmforge accepts is one DeepSpeed lacks."""
    import importlib.util
    from pathlib import Path

    from lmforge.deepspeed_config import KNOWN_KEYS

    root = Path(importlib.util.find_spec("deepspeed").origin).parent
    source = "\n".join(path.read_text(errors="replace") for path in root.rglob("*.py"))
    missing = sorted(key for key in KNOWN_KEYS if f'"{key}"' not in source and f"'{key}'" not in source)
    assert not missing
