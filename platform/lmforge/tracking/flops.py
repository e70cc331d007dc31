"""Model FLOPs utilization: achieved model FLOPs over the peak of the devices used.

Model FLOPs per token are 6N plus attention (PaLM, appendix B). The peak is the
datasheet dense figure of the job's precision for known GPUs, or measured once with
a large matmul of that precision elsewhere (a CPU has no useful datasheet number).
"""

from __future__ import annotations

import functools
import time

import torch

# Dense (no sparsity) datasheet peak TFLOP/s by device-name fragment and precision.
# "tf32" is what fp32 matmuls reach when torch lets them use TF32 tensor cores.
GPU_PEAK_TFLOPS = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6},
    "A10G": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Square matmuls this large run at a device's peak; smaller ones are bound by
# memory or launch overhead and would flatter MFU.
MEASURE_SIZE = {"cuda": 8192, "cpu": 512}


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, size: int | None = None, seconds: float = 0.2) -> float:
    """FLOP/s of a square matmul of `dtype` on `device`, best of a short loop.

    On a CPU each matmul is timed in this process's CPU time (times the threads torch
    computes with): timed by the clock, a machine busy with other processes made the
    peak look low and MFU read above 1 (seen in the suite, with ranks starting beside)."""
    size = size or MEASURE_SIZE.get(device.type, 512)
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if cuda:
            torch.cuda.synchronize()
        began = clock()
        a @ b
        if cuda:
            torch.cuda.synchronize()
        best = min(best, clock() - began)
    return 2 * size**3 / best * (1 if cuda else torch.get_num_threads())


def datasheet_key(precision: str) -> str:
    """fp32 matmuls count at the TF32 peak only when torch is allowed to use it."""
    if precision == "fp32" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return precision


def peak_flops(device: torch.device, precision: str) -> float:
    """Per-device peak for the job's precision: the datasheet's for a known GPU,
    otherwise measured with a matmul of that precision."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, peaks in GPU_PEAK_TFLOPS.items():
            if fragment in name:
                return peaks[datasheet_key(precision)] * 1e12
    return _measured_peak(device, precision, torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _measured_peak(device: torch.device, precision: str, threads: int) -> float:
    """Measured once per process and thread count (the figure counts every thread): a
    worker kept across attempts does not spend its restart timing matmuls again."""
    return measure_matmul_flops(device, DTYPES[precision])


def mfu(flops_per_step: float, step_seconds: float, peak_per_rank: float, world_size: int) -> float:
    return flops_per_step / step_seconds / (peak_per_rank * world_size)
