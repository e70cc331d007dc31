"""MFU arithmetic and the measured CPU peak."""

import pytest
import torch

from lmforge.models import PRESETS
from lmforge.tracking.flops import measure_matmul_flops, mfu, peak_flops


def test_mfu_is_achieved_over_peak():
    assert mfu(flops_per_step=6e12, step_seconds=2.0, peak_per_rank=1e12, world_size=4) == pytest.approx(0.75)


@pytest.mark.parametrize("preset", ["7b", "1b"])
def test_flops_per_token_is_6n_plus_attention_n_the_weights_that_multiply(preset):
    """N counted on the built model: every weight but an untied input embedding (a
    lookup); tied (1b), the shared matrix is the head's matmul and counts once."""
    from lmforge.models import Transformer

    cfg = PRESETS[preset]
    with torch.device("meta"):
        model = Transformer(cfg)
    multiplying = sum(p.numel() for name, p in model.named_parameters() if cfg.tie_embeddings or not name.startswith("tok_embeddings"))
    assert cfg.flops_per_token(4096) == 6 * multiplying + 12 * cfg.n_layers * cfg.dim * 4096


def test_cpu_peak_is_measured_in_the_jobs_precision_and_plausible():
    flops = measure_matmul_flops(torch.device("cpu"), size=256, seconds=0.05)
    assert 1e8 < flops < 1e14
    assert peak_flops(torch.device("cpu"), "fp32") > 1e8
    assert 1e6 < measure_matmul_flops(torch.device("cpu"), torch.bfloat16, size=128, seconds=0.05) < 1e14


def test_a_processs_cpu_peak_is_measured_once_per_precision(monkeypatch):
    """A worker kept for the next attempt does not time matmuls again."""
    from lmforge.tracking import flops

    timed = []
    monkeypatch.setattr(flops, "measure_matmul_flops", lambda device, dtype: timed.append(dtype) or 1e9)
    flops._measured_peak.cache_clear()
    try:
        for precision in ("fp32", "bf16", "fp32", "bf16"):
            assert peak_flops(torch.device("cpu"), precision) == 1e9
    finally:
        flops._measured_peak.cache_clear()
    assert timed == [torch.float32, torch.bfloat16]


@pytest.fixture
def an_h100(monkeypatch):
    """No GPU here: only the device's name is faked, which is all the datasheet lookup reads."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    yield torch.device("cuda")
    torch.set_float32_matmul_precision("highest")


def test_a_known_gpus_peak_is_the_datasheets_for_the_precision(an_h100):
    assert peak_flops(an_h100, "bf16") == peak_flops(an_h100, "fp16") == pytest.approx(989.4e12)
    assert peak_flops(an_h100, "fp32") == pytest.approx(66.9e12)  # no TF32: the plain fp32 figure
    torch.set_float32_matmul_precision("high")  # matmuls may use TF32 tensor cores
    assert peak_flops(an_h100, "fp32") == pytest.approx(494.7e12)
