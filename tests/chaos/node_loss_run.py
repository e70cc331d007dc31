"""Runs a dp=2 job on a 3-node cluster (a 1-CPU head, two 2-CPU worker nodes with
one rank each), removes one worker node abruptly mid-run, and writes both summaries
as JSON: the uninterrupted run first (same cluster, job name "whole"), then the one
that lost a node. Launched by test_node_loss.py.

    python node_loss_run.py JOB.json RESULT.json
"""

import json
import sys
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).parents[1]))
from multinode import start_cluster  # noqa: E402

from chaos import when_step_reached  # noqa: E402
from lmforge import sdk  # noqa: E402
from lmforge.spec import spec_from_dict  # noqa: E402


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    cluster, workers = start_cluster(worker_nodes=2, cpus_per_node=2)
    try:
        whole = sdk.train(spec_from_dict(job | {"name": "whole"}), show_progress=False)
        run_dir = Path(job["output_dir"]) / job["name"]
        watcher = when_step_reached(run_dir, 5, lambda: cluster.remove_node(workers[1], allow_graceful=False))
        shrunk = sdk.train(spec_from_dict(job), show_progress=False)
        watcher.join(timeout=5)
        Path(sys.argv[2]).write_text(json.dumps({"whole": whole, "shrunk": shrunk}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
