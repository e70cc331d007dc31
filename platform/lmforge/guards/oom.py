"""Out-of-memory in a step: a report of where the memory went, and the smaller
micro-batch to retry with (the same global batch, so the data order holds)."""

from __future__ import annotations

import torch

from lmforge.memory.estimate import estimate
from lmforge.spec import JobSpec


def memory_report(spec: JobSpec, rank: int, step: int, device: torch.device, error: BaseException) -> str:
    """The estimator's breakdown for this rank (everywhere) and, on a GPU, the
    allocator's own summary."""
    b = estimate(spec, rank)
    p = spec.parallel
    lines = [
        f"out of memory at step {step} on rank {rank}: {str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}",
        f"layout: tp {p.tp} pp {p.pp} dp {p.dp} zero {p.zero}, activation checkpointing {p.activation_checkpointing}, "
        f"micro-batch {spec.train.micro_batch} x {spec.grad_accum} accumulation, seq_len {spec.train.seq_len}, {spec.train.precision}",
        "estimated bytes on this rank (lmforge plan):",
    ]
    for name, value in b.as_dict().items():
        if name != "rank":
            lines.append(f"  {name:<13} {value:>16,}  ({value / 2**30:.3f} GiB)")
    if device.type == "cuda":
        lines += ["", torch.cuda.memory_summary(device)]
    return "\n".join(lines) + "\n"


def with_smaller_micro_batch(spec: JobSpec) -> JobSpec | None:
    """The job with half the micro-batch, or the largest smaller one the job's rules
    accept (the global batch whole at every dp it may run on), not below
    `guards.oom_min_micro_batch`; None when there is none."""
    for micro in range(spec.train.micro_batch // 2, max(1, spec.guards.oom_min_micro_batch) - 1, -1):
        try:
            return spec.with_changes("train", micro_batch=micro)
        except ValueError:  # pydantic's ValidationError: this size breaks a rule
            continue
    return None
