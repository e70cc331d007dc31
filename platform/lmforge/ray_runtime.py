"""Connecting to Ray: join the cluster we are given, or start an embedded local one.
And how a rank process uses its host (threads, freed memory).

Under `ray job submit` (RAY_ADDRESS is set) or with an explicit address, lmforge
joins; otherwise it starts a private local cluster sized for the job.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
from contextlib import contextmanager
from typing import Iterator

import ray

from lmforge.errors import UserError

# Rank processes must not oversubscribe the cores; torch reads this at import
# (each Worker sets it before importing torch).
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# glibc's mallopt parameters: allocations below the first come from the heap (its
# largest value), and freed heap memory is returned to the kernel only past the second.
_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD = -3, -1
_KEPT_FREE_BYTES = 1 << 30


def tune_process(threads: int) -> None:
    """Settings for a process that computes with torch on the CPU: its thread count, and
    freed tensor memory kept for reuse as CUDA's caching allocator keeps it. By default
    glibc hands a freed vocabulary-wide buffer back to the kernel and faults the next
    one in page by page, which costs as much as a pass over it (measured: a distillation
    loss 1.7x slower). Not glibc: the threads only.

    What the process has loaded by now (torch's and lmforge's modules, a million
    objects) is never garbage: frozen, it is left out of every later collection, the
    interpreter's own during training and a worker's between attempts (measured:
    0.2-0.3 s of CPU each)."""
    import torch

    torch.set_num_threads(threads)
    gc.freeze()
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, _KEPT_FREE_BYTES)
    except (OSError, AttributeError):
        pass


# CPUs kept free of rank actors: Ray Data's reads and its Parquet metadata tasks
# need a whole CPU to be scheduled, and would wait forever behind the ranks.
DATA_CPUS = 1


def embedded_resources(address: str | None = None) -> dict | None:
    """What `connect` would start, {"CPU": n, "GPU": n}, or None when it would join a
    cluster (or Ray is up already): at least 4 logical CPUs for ranks (they run one
    thread each, so more than the cores is safe), plus Ray Data's reserve, and the
    GPUs torch sees. Known before anything starts, so a job too large for it is
    refused without starting one."""
    if ray.is_initialized() or address or os.environ.get("RAY_ADDRESS"):
        return None
    import torch

    return {"CPU": float(max(4, os.cpu_count() or 1) + DATA_CPUS), "GPU": float(torch.cuda.device_count())}


def connect(address: str | None = None) -> bool:
    """Initialize Ray once. Returns True when this call started an embedded cluster
    (sized by `embedded_resources`)."""
    if ray.is_initialized():
        return False
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING, "configure_logging": True}
    embedded = embedded_resources(address)
    if embedded is None:
        address = address or os.environ["RAY_ADDRESS"]
        try:
            ray.init(address=address, **quiet)
        except ConnectionError as err:
            raise UserError(f"cannot reach the Ray cluster at {address} ({err})") from None
        return False
    ray.init(address="local", num_cpus=int(embedded["CPU"]), num_gpus=int(embedded["GPU"]), include_dashboard=False, **quiet)
    return True


@contextmanager
def joined(address: str | None = None) -> Iterator[None]:
    """Ray for the block: the cluster at `address` joined, or an embedded one started
    (and stopped after)."""
    started = connect(address)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def check_capacity(
    workers: int, cpus_per_worker: float, gpus_per_worker: float, field: str = "resources", hint: str = "", total: dict | None = None
) -> None:
    """Refuse a world size the cluster (`total`, by default the one Ray is connected
    to) cannot hold, with CPUs left for reading data, instead of waiting forever."""
    total = ray.cluster_resources() if total is None else total
    cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
    need_cpus, need_gpus = workers * cpus_per_worker + DATA_CPUS, workers * gpus_per_worker
    if need_cpus > cpus or need_gpus > gpus:
        raise UserError(
            f"{field}: {workers} workers x ({cpus_per_worker:g} CPU, {gpus_per_worker:g} GPU), plus "
            f"{DATA_CPUS} CPU for reading data, need {need_cpus:g} CPUs and {need_gpus:g} GPUs; the cluster has "
            f"{cpus:g} CPUs and {gpus:g} GPUs ({hint or 'lower parallel.dp or resources.cpus_per_worker, or join a larger cluster'})"
        )


def fits(workers: int, cpus_per_worker: float, gpus_per_worker: float) -> bool:
    try:
        check_capacity(workers, cpus_per_worker, gpus_per_worker)
    except UserError:
        return False
    return True
