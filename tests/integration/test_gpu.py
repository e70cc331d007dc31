"""Paths that need a GPU: FSDP2 CPU offload (pinned host memory needs an
accelerator; on CPU torch refuses), fp16 with loss scaling on both engines (DeepSpeed's
is refused on CPUs without AVX512-FP16; the native one's runs on CPU too: test_engine_parity), the pre-flight check against a GPU's own memory and the
allocator's summary in an out-of-memory report. Skipped, with that reason, where no GPU is visible;
run on a GPU machine with `pytest tests/integration/test_gpu.py`."""

import re

import pytest
import torch
from parity import losses, result

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU = ["--device", "cuda"]
ON_GPU = "resources.gpus_per_worker=1"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return losses(tmp_path_factory.mktemp("gpu-ref"), 1, ON_GPU, extra=GPU)


@pytest.mark.parametrize("zero", [3, 2])
def test_fsdp2_cpu_offload_matches_one_gpu(reference, tmp_path, zero):
    """One fp32 rank, which needs no FSDP otherwise: offload is applied all the same,
    and the model states are where the plan puts them (none in GPU memory)."""
    got, engine = losses(tmp_path, 1, ON_GPU, "parallel.cpu_offload=true", f"parallel.zero={zero}", extra=GPU, describe=True)
    assert got == pytest.approx(reference, rel=1e-4)
    assert engine["fsdp_units"] > 0 and engine["offloaded_units"] == engine["fsdp_units"], engine
    assert engine["state_devices"] == ["cpu"], engine


@pytest.mark.parametrize("engine", ["deepspeed", "native"])
def test_fp16_with_loss_scaling_is_close_to_fp32_and_its_scaler_acts(reference, tmp_path, engine):
    """Step 3's gradients overflow (injected): the scaler skips it and halves its scale,
    whichever engine scales; the steps before are close to fp32's."""
    on_engine = ["engine=deepspeed", "deepspeed.config.zero_optimization.stage=2", "deepspeed.config.fp16.initial_scale_power=8"]
    on_engine.append("deepspeed.config.fp16.hysteresis=1")  # halve at the first overflow, as the native scale does
    ran = result(tmp_path, 1, ON_GPU, "train.precision=fp16", "debug.overflow_at_steps=[3]", *(on_engine if engine == "deepspeed" else []), extra=GPU)
    scales = ran["loss_scales"]
    assert scales[3] == scales[2] / 2 and scales[0] == scales[2], scales
    assert ran["losses"][:3] == pytest.approx(reference[:3], rel=2e-2)
    assert ran["losses"][:3] != pytest.approx(reference[:3], rel=1e-7), "fp16 produced fp32 numbers"


def test_deepspeed_zero3_param_offload_matches_one_gpu(reference, tmp_path):
    got = losses(
        tmp_path,
        1,
        ON_GPU,
        "engine=deepspeed",
        "deepspeed.config.zero_optimization.stage=3",
        "deepspeed.config.zero_optimization.offload_param.device=cpu",
        "deepspeed.config.zero_optimization.offload_optimizer.device=cpu",
        extra=GPU,
    )
    assert got == pytest.approx(reference, rel=1e-4)


def test_preflight_refuses_a_job_larger_than_this_gpu():
    from lmforge.errors import UserError
    from lmforge.planner.fit import check_fits
    from lmforge.spec import spec_from_dict

    spec = spec_from_dict(
        {
            "name": "big",
            "model": {"preset": "70b"},
            "parallel": {"dp": 1, "zero": 0},
            "train": {"global_batch": 1, "micro_batch": 1, "seq_len": 4096, "precision": "bf16"},
            "resources": {"gpus_per_worker": 1},
            "data": {"path": "unused"},
        }
    )
    total, name = torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    with pytest.raises(UserError, match=re.escape(f"{name} memory: rank 0 needs an estimated")):
        check_fits(spec, total, f"{name} memory")


def test_out_of_memory_report_has_the_allocators_summary():
    from lmforge.guards.memory_report import memory_report
    from lmforge.spec import spec_from_dict

    spec = spec_from_dict({"name": "r", "data": {"path": "unused"}})
    held = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    report = memory_report(spec, 0, 7, torch.device("cuda", 0), torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert "out of memory at step 7 on rank 0: CUDA out of memory" in report and "PyTorch CUDA memory summary" in report
    del held
