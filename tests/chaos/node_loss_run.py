"""Runs a dp=2 job on a 3-node cluster (a 1-CPU head, two 2-CPU worker nodes with
one rank each), removes one worker node abruptly mid-run, adds a node back once the
job has recovered on what was left, and writes both summaries as JSON: the
uninterrupted run first (same cluster, job name "whole"), then the one that lost a
node and got one back; then, on a third worker node, the same job at a fixed dp 2
with a spare rank, losing a rank's node again. Launched by test_node_loss.py.

    python node_loss_run.py JOB.json RESULT.json
"""

import json
import sys
import threading
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).parents[1]))
from multinode import start_cluster  # noqa: E402

from chaos import events, reached_step, recorded_event, wait_until  # noqa: E402
from lmforge import sdk  # noqa: E402
from lmforge.spec import spec_from_dict  # noqa: E402


def spared_run(cluster, job: dict) -> dict:
    """The same job at a fixed dp 2 with one spare rank (on a third worker node): a
    rank's node is removed, and the job restarts on the spare's capacity."""
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    job = job | {"name": "spared", "fault_tolerance": job["fault_tolerance"] | {"spares": 1}}
    job.pop("elastic")
    run_dir = Path(job["output_dir"]) / job["name"]
    outcome: dict = {}
    training = threading.Thread(target=lambda: outcome.update(summary=sdk.train(spec_from_dict(job), show_progress=False)))
    training.start()
    wait_until(reached_step(run_dir, 5))
    layout = next(e for e in events(run_dir) if e["event"] == "layout")
    rank_1_node = next(n for n in cluster.list_all_nodes() if n.node_id.startswith(layout["ranks"][1]["node"]))
    cluster.remove_node(rank_1_node, allow_graceful=False)
    training.join()
    return outcome["summary"]


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    cluster, workers = start_cluster(worker_nodes=2, cpus_per_node=2)
    try:
        whole = sdk.train(spec_from_dict(job | {"name": "whole"}), show_progress=False)
        run_dir = Path(job["output_dir"]) / job["name"]
        # The job trains in a thread: Ray adds nodes only from the main thread.
        outcome: dict = {}
        training = threading.Thread(target=lambda: outcome.update(shrunk=sdk.train(spec_from_dict(job), show_progress=False)))
        training.start()
        wait_until(reached_step(run_dir, 5))
        cluster.remove_node(workers[1], allow_graceful=False)
        wait_until(recorded_event(run_dir, "recovered"))
        cluster.add_node(num_cpus=2)
        training.join()
        outcome["spared"] = spared_run(cluster, job)
        Path(sys.argv[2]).write_text(json.dumps({"whole": whole} | outcome))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
