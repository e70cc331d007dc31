"""MFU arithmetic and the measured CPU peak."""

import pytest
import torch

from lmforge.models import PRESETS
from lmforge.tracking.flops import measure_matmul_flops, mfu, peak_flops


def test_mfu_is_achieved_over_peak():
    assert mfu(flops_per_step=6e12, step_seconds=2.0, peak_per_rank=1e12, world_size=4) == pytest.approx(0.75)


def test_flops_per_token_is_6n_plus_attention():
    cfg = PRESETS["7b"]
    assert cfg.flops_per_token(4096) == 6 * cfg.num_params() + 12 * 32 * 4096 * 4096


def test_cpu_peak_is_measured_and_plausible():
    flops = measure_matmul_flops(torch.device("cpu"), size=256, seconds=0.05)
    assert 1e8 < flops < 1e14
    assert peak_flops(torch.device("cpu"), "fp32") > 1e8
