"""The DeepSpeed engine trains like the native one.

Real DeepSpeed 0.19 on CPU with gloo, launched by torchrun: each ZeRO stage, with
and without CPU offload, against the native engine's data-parallel run (fp32,
10 steps, 1e-4 relative). What ran is read back from DeepSpeed itself, so a
silently ignored setting fails the test.
"""

import pytest

from parity import losses, run_cases

STEPS = ["--steps", "10"]
OFFLOAD_OPT = "deepspeed.config.zero_optimization.offload_optimizer.device=cpu"
OFFLOAD_PARAM = "deepspeed.config.zero_optimization.offload_param.device=cpu"


STAGES = {
    "zero0": (0, []), "zero1": (1, []), "zero2": (2, []), "zero3": (3, []),
    "zero1-offload": (1, [OFFLOAD_OPT]), "zero2-offload": (2, [OFFLOAD_OPT]), "zero3-offload-all": (3, [OFFLOAD_OPT, OFFLOAD_PARAM]),
}
ZERO = "deepspeed.config.zero_optimization.stage"
# One launch for every 2-rank comparison: starting torch and DeepSpeed in each rank
# costs more than these runs.
CASES = {
    "native": [],
    **{name: ["engine=deepspeed", f"{ZERO}={stage}", *offload] for name, (stage, offload) in STAGES.items()},
    "zero3-ac": ["engine=deepspeed", f"{ZERO}=3", "parallel.activation_checkpointing=full"],
    "zero2-bf16": ["engine=deepspeed", f"{ZERO}=2", "train.precision=bf16"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_cases(tmp_path_factory.mktemp("ds"), 2, {name: {"overrides": items, "steps": 10} for name, items in CASES.items()})


@pytest.fixture(scope="module")
def native_dp2(runs):
    return runs["native"]["losses"]


@pytest.mark.parametrize("name", STAGES)
def test_zero_stages_match_native_data_parallel(native_dp2, runs, name):
    stage, offload = STAGES[name]
    got, ran = runs[name]["losses"], runs[name]["engine"]
    assert ran["class"] == "DeepSpeedEngine" and ran["zero_stage"] == stage
    assert ran["offload_optimizer"] in (("cpu",) if offload else (None, "none"))
    assert ran["offload_param"] in (("cpu",) if OFFLOAD_PARAM in offload else (None, "none"))
    assert ran["optimizer"] == "AdamW", "torch's AdamW: no compiled DeepSpeed Adam in the suite"
    assert got == pytest.approx(native_dp2, rel=1e-4)
    assert got[-1] < got[0]


def test_activation_checkpointing_under_zero3(native_dp2, runs):
    assert runs["zero3-ac"]["losses"] == pytest.approx(native_dp2, rel=1e-4)


def _cpu_adam_build_cached() -> bool:
    import os
    import sys
    from pathlib import Path

    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_{'cu' + torch.version.cuda.replace('.', '') if torch.version.cuda else 'cpu'}"
    )
    return any(Path(root, "cpu_adam").glob("cpu_adam*.so"))


@pytest.mark.skipif(not _cpu_adam_build_cached(), reason="DeepSpeedCPUAdam is not built in the torch extensions cache; building it takes minutes")
def test_compiled_cpu_adam_with_offload(native_dp2, tmp_path):
    got, ran = losses(tmp_path, 2, "engine=deepspeed", "deepspeed.config.zero_optimization.stage=2", OFFLOAD_OPT,
                      "deepspeed.config.optimizer.type=AdamW", "deepspeed.config.optimizer.params.torch_adam=false", extra=STEPS, describe=True)
    assert ran["optimizer"] == "DeepSpeedCPUAdam"
    assert got == pytest.approx(native_dp2, rel=1e-4)


def test_bf16_is_close_to_fp32(native_dp2, runs):
    got = runs["zero2-bf16"]["losses"]
    assert got == pytest.approx(native_dp2, rel=2e-2)
    assert got != pytest.approx(native_dp2, rel=1e-7), "bf16 produced fp32 numbers"


@pytest.mark.parametrize("source, target", [("native", "deepspeed"), ("deepspeed", "native")])
def test_exported_weights_move_between_engines(tmp_path, source, target):
    """Train 6 steps saving at 3; export step 3 with the CLI; the other engine started
    from the export on step 4's batch computes step 4's loss."""
    import subprocess
    import sys

    engine_args = {"native": [], "deepspeed": ["engine=deepspeed", "deepspeed.config.zero_optimization.stage=3"]}
    ckpt, exported = tmp_path / "ckpt", tmp_path / "exported"
    trained = losses(tmp_path, 2, *engine_args[source], extra=["--save", str(ckpt), "--save-at", "3"])
    result = subprocess.run([sys.executable, "-m", "lmforge", "export", str(ckpt / "step_00000003"), "--out", str(exported)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "model.safetensors"]
    continued = losses(tmp_path, 2, *engine_args[target], f"model.init_from={exported}", extra=["--skip-steps", "3"])
    assert continued[0] == pytest.approx(trained[3], rel=1e-5)


@pytest.mark.parametrize("stage, nproc", [(0, 1), (2, 1), (3, 4)])
def test_resume_on_another_dp_size(tmp_path, stage, nproc):
    """Saved on dp 2 after 3 steps, continued on dp 1 or 4 (ZeRO partitions through
    DeepSpeed's universal checkpoint): the remaining steps' losses are those of dp 2."""
    ds = ["engine=deepspeed", f"deepspeed.config.zero_optimization.stage={stage}"]
    ckpt = tmp_path / "ckpt"
    trained = losses(tmp_path, 2, *ds, extra=["--save", str(ckpt), "--save-at", "3"])
    continued = losses(tmp_path, nproc, *ds, extra=["--load", str(ckpt)])
    assert continued == pytest.approx(trained[3:], rel=1e-4)
    assert (ckpt / "step_00000003" / "universal").is_dir() == (stage > 0)
