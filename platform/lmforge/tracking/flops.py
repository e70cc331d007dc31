"""Model FLOPs utilization: achieved model FLOPs over the peak of the devices used.

Model FLOPs per token are 6N plus attention (PaLM, appendix B). The peak is the
datasheet dense bf16/fp32 figure for known GPUs, or measured once with a matmul
on a CPU (which has no useful datasheet number).
"""

from __future__ import annotations

import time

import torch

# Dense (no sparsity) peak TFLOP/s by device-name fragment: (bf16, fp32 via TF32).
GPU_PEAK_TFLOPS = {
    "H200": (989.0, 494.0),
    "H100": (989.0, 494.0),
    "A100": (312.0, 156.0),
    "L40S": (362.0, 183.0),
    "A10G": (125.0, 62.5),
}


def measure_matmul_flops(device: torch.device, size: int = 512, seconds: float = 0.2) -> float:
    """FLOP/s of a square fp32 matmul on `device`, best of a short loop."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    a @ b  # warm-up
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        began = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - began)
    return 2 * size**3 / best


def peak_flops(device: torch.device, precision: str) -> float:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, (bf16, fp32) in GPU_PEAK_TFLOPS.items():
            if fragment in name:
                return (bf16 if precision == "bf16" else fp32) * 1e12
    return measure_matmul_flops(device)


def mfu(flops_per_step: float, step_seconds: float, peak_per_rank: float, world_size: int) -> float:
    return flops_per_step / step_seconds / (peak_per_rank * world_size)
