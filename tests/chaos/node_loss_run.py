"""Runs a dp=2 job on a `ray.cluster_utils.Cluster` (a 1-CPU head for the driver,
controller and data, and two 2-CPU worker nodes, one rank each), removes one worker
node abruptly mid-run, and prints both summaries as JSON: the uninterrupted run
first (same cluster, another job name), then the one that lost a node.
Its own process, since a process joins only one Ray cluster.

    python node_loss_run.py JOB.json
"""

import json
import logging
import socket
import sys
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from lmforge import sdk
from lmforge.spec import spec_from_dict

from chaos import when_step_reached


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "gcs_server_port": free_port(), "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=2) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        whole = sdk.train(spec_from_dict(job | {"name": "whole"}), show_progress=False)
        run_dir = Path(job["output_dir"]) / job["name"]
        watcher = when_step_reached(run_dir, 5, lambda: cluster.remove_node(workers[1], allow_graceful=False))
        shrunk = sdk.train(spec_from_dict(job), show_progress=False)
        watcher.join(timeout=5)
        print(json.dumps({"whole": whole, "shrunk": shrunk}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
