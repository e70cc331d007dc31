"""Runs a tp=2 x dp=2 job on a 3-node `ray.cluster_utils.Cluster` (a head and two
2-CPU worker nodes, all on this machine) and prints the summary as JSON.
Launched as its own process by test_placement.py, since a process joins only one
Ray cluster.

    python multinode_run.py JOB.json
"""

import json
import logging
import socket
import sys

import ray
from ray.cluster_utils import Cluster

from lmforge import sdk
from lmforge.spec import spec_from_dict


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    # The head's single CPU serves Ray Data's read tasks; each worker node holds
    # exactly one TP group's bundle (2 ranks x 1 CPU).
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "gcs_server_port": free_port(), "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        summary = sdk.train(spec_from_dict(job), show_progress=False)
        summary["nodes"] = sorted(n["NodeID"][:12] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU") == 2)
        print(json.dumps(summary))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
