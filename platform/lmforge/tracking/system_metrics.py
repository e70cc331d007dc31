"""Each node's CPU, memory, disk, network and GPU use, sampled into the job's MLflow
run by MLflow's own monitor, running beside one rank per node (the controller picks
it) so that every machine the job trains on is seen, and none twice."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from lmforge.spec import JobSpec


def start_monitor(spec: JobSpec, on_this_node: bool):
    """A started monitor logging `system/<host>/...` metrics, or None (not this rank's
    job, tracking off, or no run yet). Steps continue across attempts of the run."""
    tracking = spec.tracking
    if not (on_this_node and tracking.enabled and tracking.run_id and tracking.system_metrics_s > 0):
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(
        tracking.run_id,
        sampling_interval=tracking.system_metrics_s,
        resume_logging=True,
        node_id=socket.gethostname(),
        tracking_uri=spec.tracking_uri,
    )
    monitor.start()
    return monitor


def stop_monitor(monitor: Optional[object]) -> None:
    if monitor is not None:
        monitor.finish()  # logs what it sampled since its last write
