"""Connecting to Ray: join the cluster we are given, or start an embedded local one.

Under `ray job submit` (RAY_ADDRESS is set) or with an explicit address, lmforge
joins; otherwise it starts a private local cluster sized for the job.
"""

from __future__ import annotations

import logging
import os

import ray

from lmforge.errors import UserError

# Rank processes must not oversubscribe the cores; torch reads this at import.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def connect(address: str | None = None) -> bool:
    """Initialize Ray once. Returns True when this call started an embedded cluster."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING, "configure_logging": True}
    if address:
        try:
            ray.init(address=address, **quiet)
        except ConnectionError as err:
            raise UserError(f"cannot reach the Ray cluster at {address} ({err})") from None
        return False
    # Logical CPUs beyond the cores keep Ray Data's readers from starving behind
    # the rank actors; the ranks themselves run one thread each.
    num_cpus = max(4, os.cpu_count() or 1)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **quiet)
    return True


def check_capacity(workers: int, cpus_per_worker: float, gpus_per_worker: float) -> None:
    """Refuse a world size the cluster cannot hold instead of waiting forever."""
    total = ray.cluster_resources()
    cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
    need_cpus, need_gpus = workers * cpus_per_worker, workers * gpus_per_worker
    if need_cpus > cpus or need_gpus > gpus:
        raise UserError(
            f"resources: {workers} workers x ({cpus_per_worker:g} CPU, {gpus_per_worker:g} GPU) need "
            f"{need_cpus:g} CPUs and {need_gpus:g} GPUs; the cluster has {cpus:g} CPUs and {gpus:g} GPUs "
            "(lower parallel.dp or resources.cpus_per_worker, or join a larger cluster)"
        )
