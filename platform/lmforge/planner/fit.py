"""Refusing a job that will not fit before it trains: its largest rank's estimate
against the device memory (`resources.memory_per_worker`, or a GPU's own), with the
breakdown and the best layout that does fit in the message."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.errors import UserError
from lmforge.memory.estimate import Breakdown, worst_rank
from lmforge.planner.cluster import assumed_cluster
from lmforge.planner.search import search

if TYPE_CHECKING:
    from lmforge.spec import JobSpec


def check_fits(spec: JobSpec, device_bytes: int, source: str) -> None:
    """UserError naming `source` (the field or device the limit came from) when the
    job's largest rank needs more than the usable part of `device_bytes`."""
    cluster = assumed_cluster(spec.world_size, gpu_mem=device_bytes)
    peak = worst_rank(spec)
    if peak.device_total <= cluster.usable:
        return
    raise UserError(
        f"{source}: rank {peak.rank} needs an estimated {_gib(peak.device_total)} ({describe(peak)}), more than the "
        f"{_gib(cluster.usable)} usable of {_gib(device_bytes)} per worker; {alternative(spec, cluster)}"
    )


def describe(peak: Breakdown) -> str:
    parts = [
        ("parameters", peak.params),
        ("gradients", peak.grads),
        ("optimizer", peak.optimizer),
        *([("teacher", peak.teacher)] if peak.teacher else []),
        ("activations", peak.activations),
        ("temporary", peak.temporary),
    ]
    return ", ".join(f"{name} {_gib(n)}" for name, n in parts)


def alternative(spec: JobSpec, cluster) -> str:
    try:
        found = search(spec, cluster)
    except UserError:
        return "lower the ZeRO stage's footprint or offload in deepspeed.config"
    if not found:
        return f"no layout of {spec.world_size} workers fits; use more workers or a smaller model, seq_len or micro-batch"
    best = found[0]
    return f"the best layout that fits: {best.layout} (see lmforge plan JOB --search)"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
