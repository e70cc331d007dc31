"""Operators' metrics, exported through Ray's metrics API: each node's metrics agent
serves them to Prometheus (Ray adds a `ray_` prefix), beside Ray's own, and Ray's
dashboard and `k8s/grafana/lmforge.json` chart them. Ranks export their own step
figures; the controller exports the job's events."""

from __future__ import annotations

import os
from typing import Optional

from lmforge.events import Checkpoint, Eval, Event, Failure, Recovered, Resized, Step

# name: (kind, description, tag keys); the job's name tags every series.
RANK_METRICS = {
    "lmforge_tokens_per_second": ("gauge", "Tokens trained per second (the whole job's, seen by this rank)"),
    "lmforge_step_seconds": ("gauge", "Wall time of the rank's last optimizer step"),
    "lmforge_mfu": ("gauge", "Model FLOPs utilization of the last step"),
    "lmforge_data_wait_seconds": ("gauge", "Time the last step waited for its batch"),
    "lmforge_memory_bytes": ("gauge", "Device memory allocated on the rank (host resident memory on CPU)"),
    "lmforge_step": ("gauge", "The last optimizer step the rank finished"),
}
JOB_METRICS = {
    "lmforge_eval_loss": ("gauge", "Held-out loss at the last evaluation"),
    "lmforge_checkpoint_stall_seconds": ("gauge", "Training time the last checkpoint paused"),
    "lmforge_failures_total": ("counter", "Failures the controller recovered from (or gave up on)"),
    "lmforge_recoveries_total": ("counter", "Recoveries: the first trained step after a failure"),
    "lmforge_resizes_total": ("counter", "Elastic resizes (shrink or grow of the data-parallel size)"),
    "lmforge_recovery_seconds": ("gauge", "Seconds from the last failure to the next trained step"),
}


def _make(name: str, kind: str, description: str, tag_keys: tuple[str, ...]):
    from ray.util import metrics

    cls = metrics.Counter if kind == "counter" else metrics.Gauge
    return cls(name, description=description, tag_keys=tag_keys)


class RankMetrics:
    """One rank's gauges, set after each of its steps."""

    def __init__(self, job: str, rank: int):
        self.tags = {"job": job, "rank": str(rank)}
        self.series = {name: _make(name, kind, text, ("job", "rank")) for name, (kind, text) in RANK_METRICS.items()}

    def step(self, row: Step, memory_bytes: Optional[int] = None) -> None:
        values = {
            "lmforge_tokens_per_second": row.tokens_per_s,
            "lmforge_step_seconds": row.step_time,
            "lmforge_mfu": row.mfu,
            "lmforge_data_wait_seconds": row.data_wait,
            "lmforge_step": row.step,
            "lmforge_memory_bytes": memory_bytes if memory_bytes is not None else resident_bytes(),
        }
        for name, value in values.items():
            self.series[name].set(value, tags=self.tags)


class JobMetrics:
    """The job's counters and gauges, from the events the controller relays."""

    def __init__(self, job: str):
        self.tags = {"job": job}
        self.series = {name: _make(name, kind, text, ("job",)) for name, (kind, text) in JOB_METRICS.items()}

    def observe(self, event: Event) -> None:
        if isinstance(event, Eval):
            self.series["lmforge_eval_loss"].set(event.eval_loss, tags=self.tags)
        elif isinstance(event, Checkpoint):
            self.series["lmforge_checkpoint_stall_seconds"].set(event.stall_seconds, tags=self.tags)
        elif isinstance(event, Failure):
            self.series["lmforge_failures_total"].inc(1, tags=self.tags)
        elif isinstance(event, Recovered):
            self.series["lmforge_recoveries_total"].inc(1, tags=self.tags)
            self.series["lmforge_recovery_seconds"].set(event.seconds, tags=self.tags)
        elif isinstance(event, Resized):
            self.series["lmforge_resizes_total"].inc(1, tags=self.tags)


def resident_bytes() -> int:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss
