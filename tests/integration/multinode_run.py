"""Runs a tp=2 x dp=2 job on a 3-node cluster (a head and two 2-CPU worker nodes,
all on this machine) and writes the summary as JSON. Launched by test_placement.py.

    python multinode_run.py JOB.json RESULT.json
"""

import json
import sys
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).parents[1]))
from multinode import start_cluster  # noqa: E402

from lmforge import sdk  # noqa: E402
from lmforge.spec import spec_from_dict  # noqa: E402


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    # Each worker node holds exactly one TP group's bundle (2 ranks x 1 CPU).
    cluster, _ = start_cluster(worker_nodes=2, cpus_per_node=2)
    try:
        summary = sdk.train(spec_from_dict(job), show_progress=False)
        summary["nodes"] = sorted(n["NodeID"][:12] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU") == 2)
        Path(sys.argv[2]).write_text(json.dumps(summary))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
