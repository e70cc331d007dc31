"""A rank's report of where the memory went when a step ran out of it: the
estimator's breakdown for this rank and, on a GPU, the allocator's own summary."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmforge.memory.estimate import estimate

if TYPE_CHECKING:
    from lmforge.spec import JobSpec


def memory_report(spec: JobSpec, rank: int, step: int, device: torch.device, error: BaseException) -> str:
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
