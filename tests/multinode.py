"""Several Ray nodes on this machine (`ray.cluster_utils.Cluster`), for scripts
that tests launch as their own processes (a process joins only one Ray cluster)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from ports import free_port

# Ray keeps at most this many idle worker processes per node, by default as many as
# the node has CPUs: with the 1- and 2-CPU nodes here that meant killing the worker
# processes Ray Data's reads had just used and starting new ones for the next read
# (measured: 54 processes started for the four scenarios, 123 CPU-seconds; 17 with this).
IDLE_WORKERS_PER_NODE = 16


def start_cluster(worker_nodes: int, cpus_per_node: int) -> tuple[Cluster, list]:
    """A 1-CPU head (the driver, controller and Ray Data's reads) plus worker nodes,
    joined by this process."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            # Ray 2.60 starts its API server even without the dashboard: on a port of its own.
            "num_cpus": 1,
            "gcs_server_port": free_port(),
            "include_dashboard": False,
            "dashboard_port": free_port(),
            "_system_config": {"num_workers_soft_limit": IDLE_WORKERS_PER_NODE},
        },
    )
    nodes = [cluster.add_node(num_cpus=cpus_per_node) for _ in range(worker_nodes)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
    return cluster, nodes


def run_script(script: Path, job: dict, workdir: Path, timeout_s: float = 600) -> dict:
    """Run `script JOB.json RESULT.json` in its own session and return what it wrote
    to RESULT.json (not stdout: Ray's own log lines land there too)."""
    job_file, result_file = workdir / "job.json", workdir / "result.json"
    job_file.write_text(json.dumps(job))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(job_file), str(result_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        start_new_session=True,
        cwd=script.parent,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and every Ray process it started
        out, err = proc.communicate()
        raise AssertionError(f"{script.name} did not finish within {timeout_s:.0f}s; the end of its stderr:\n{err[-4000:]}") from None
    assert proc.returncode == 0, err[-4000:]
    return json.loads(result_file.read_text())
