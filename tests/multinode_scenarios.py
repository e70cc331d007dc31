"""Every multi-node scenario, on one cluster (a 1-CPU head and two 2-CPU worker
nodes, all on this machine; starting one is slow), in this order:

0. prepare: `data prepare` of a corpus, its packing spread over the nodes;
1. placement: a tp=2 x dp=2 job; each worker node can hold one TP group;
2. whole: the elastic dp=2 job, one rank per worker node, uninterrupted;
3. shrunk: the same job, losing rank 0's node abruptly mid-run, then getting a
   node back once it has recovered on dp 1 (it should grow back to dp 2); run as a
   user runs it, `lmforge train JOB` with its progress on, into an output directory
   whose name rich would read as markup (`CLI_DIR`);
4. spared: the same job at a fixed dp 2 with one spare rank on a third worker
   node and in-memory checkpoints, losing a rank's node (before the first storage
   checkpoint) while a rival placement group waits for a node;
5. topology: pp2 x dp2 x tp2 slots reserved by the placement rule (no ranks start):
   on 2-CPU nodes, on 2-CPU nodes labelled by rack, on 4-CPU nodes; then `lmforge
   train` of a layout the racks cannot hold, refused before anything starts.

Writes each run's summary to RESULT.json. Launched by the `multinode` fixture.

    python multinode_scenarios.py JOBS.json RESULT.json   # {"prepare": options, "placement": job, "elastic": job, "spared_steps": n}
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import ray
import yaml
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

TESTS = Path(__file__).parent
sys.path[:0] = [str(TESTS), str(TESTS / "chaos")]
from chaos import events, reached_step, recorded_event, wait_until  # noqa: E402
from lmforge import sdk  # noqa: E402
from lmforge.cluster.capacity import Capacity, check_placement  # noqa: E402
from lmforge.data.prepare import prepare_dataset  # noqa: E402
from lmforge.data.prepare_options import PrepareOptions  # noqa: E402
from lmforge.errors import UserError  # noqa: E402
from lmforge.spec import spec_from_dict  # noqa: E402
from multinode import start_cluster  # noqa: E402


def in_background(job: dict) -> tuple[threading.Thread, dict]:
    """Train in a thread: Ray adds and removes nodes only from the main thread."""
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(summary=sdk.train(spec_from_dict(job), show_progress=False).as_json()))
    thread.start()
    return thread, outcome


CLI_DIR = "[/x]"  # a closing tag to rich: every path the driver prints holds it


def through_cli(job: dict, address: str) -> tuple[threading.Thread, dict]:
    """`lmforge train JOB --json --address ADDRESS` as a user runs it, its own process
    with its progress on, waited on in a thread: the summary, the exit code and what
    it printed."""
    job_file = Path(job["output_dir"]) / f"{job['name']}.yaml"
    job_file.parent.mkdir(parents=True, exist_ok=True)
    job_file.write_text(yaml.safe_dump(job))
    outcome: dict = {}

    def run():
        done = subprocess.run(
            [sys.executable, "-m", "lmforge", "train", str(job_file), "--json", "--address", address],
            capture_output=True,
            text=True,
            env=os.environ | {"OMP_NUM_THREADS": "1"},
            timeout=600,
        )
        summary = json.loads(done.stdout) if done.returncode == 0 else {}  # with --json, stdout holds the summary alone
        outcome["summary"] = summary | {"exit_code": done.returncode, "stderr": done.stderr}

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def placement(job: dict) -> dict:
    summary = sdk.train(spec_from_dict(job), show_progress=False)
    return summary.as_json() | {"nodes": sorted(n["NodeID"][:12] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU") == 2)}


def shrink_then_grow(cluster, job: dict) -> dict:
    """Rank 0's node goes: the survivor, rank 1 of 2, goes on as rank 0 of 1, then
    of 2 again, in the same process (kept across attempts)."""
    job = job | {"output_dir": str(Path(job["output_dir"]) / CLI_DIR)}
    run_dir = Path(job["output_dir"]) / job["name"]
    thread, outcome = through_cli(job, cluster.address)
    wait_until(reached_step(run_dir, 5))
    cluster.remove_node(node_of_rank(cluster, run_dir, 0), allow_graceful=False)
    wait_until(recorded_event(run_dir, "recovered"))
    cluster.add_node(num_cpus=2)
    thread.join()
    return outcome["summary"]


def node_of_rank(cluster, run_dir: Path, rank: int):
    layout = next(e for e in events(run_dir) if e["event"] == "layout")
    return next(n for n in cluster.list_all_nodes() if n.node_id.startswith(layout["ranks"][rank]["node"]))


def spared(cluster, job: dict, steps: int) -> dict:
    """No `elastic`: without the spare's capacity the restart could not place dp 2.
    A rival asks for a whole node before the loss: if the spare's capacity were
    ever free during the restart, the rival would take it and dp 2 would not fit."""
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    # A shorter run of the same schedule: no node comes back here, so it need not wait for one.
    job = job | {
        "name": "spared",
        "fault_tolerance": job["fault_tolerance"] | {"spares": 1},
        "train": job["train"] | {"max_steps": steps},
        "checkpoint": job["checkpoint"] | {"in_memory": True, "memory_interval": 1},
    }
    job.pop("elastic")
    run_dir = Path(job["output_dir"]) / job["name"]
    thread, outcome = in_background(job)
    wait_until(reached_step(run_dir, 5))
    rank_1_node = node_of_rank(cluster, run_dir, 1)
    rival = placement_group([{"CPU": 2}], name="rival")
    cluster.remove_node(rank_1_node, allow_graceful=False)
    wait_until(recorded_event(run_dir, "recovered"))
    rival_at_recovery = placement_group_table(rival)["state"]
    thread.join()
    remove_placement_group(rival)
    return outcome["summary"] | {"rival_at_recovery": rival_at_recovery}


TOPOLOGY = {"parallel": {"pp": 2, "dp": 2, "tp": 2}, "model": {"preset": "tiny", "vocab_size": 512, "n_layers": 2}}


def reserved(job: dict, label: str | None = None) -> list[dict]:
    """Reserve the job's slots as its controller would, and release them: per node
    used, the global ranks it would hold and its rack label."""
    spec = spec_from_dict(job | {"resources": job["resources"] | {"replica_label": label}})
    capacity = Capacity(spec, "topology/", lambda event: None, placement_timeout_s=30)
    try:
        capacity.initial(spares_optional=False)
        slot_nodes = capacity.slots.nodes()
    finally:
        capacity.release()
    racks = {node["NodeID"]: (node.get("Labels") or {}).get("rack", "") for node in ray.nodes()}
    by_node: dict[str, list[int]] = {}
    for rank in range(spec.world_size):
        by_node.setdefault(slot_nodes[rank // spec.parallel.tp], []).append(rank)
    return sorted(({"ranks": ranks, "rack": racks[node]} for node, ranks in by_node.items()), key=lambda n: n["ranks"])


def topology(cluster, job: dict) -> dict:
    """Two more 2-CPU nodes (four in all), two more labelled by rack, two of 4 CPUs:
    each check reserves on the cluster as it then is (the roomiest nodes first)."""
    job = job | TOPOLOGY | {"name": "topology"}
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    results = {"two_cpu_nodes": reserved(job)}
    for rack in ("a", "b", "a", "b"):  # created interleaved: only the label keeps a replica in one rack
        cluster.add_node(num_cpus=2, labels={"rack": rack})
    cluster.wait_for_nodes()
    results["by_rack"] = reserved(job, "rack")
    for _ in range(2):
        cluster.add_node(num_cpus=4)
    cluster.wait_for_nodes()
    results["four_cpu_nodes"] = reserved(job)
    # a replica of three stages; each rack holds two 2-CPU nodes: room for four TP groups, but not three in one rack
    refused = job | {
        "parallel": {"pp": 3, "dp": 1, "tp": 2},
        "model": job["model"] | {"n_layers": 3},
        "resources": job["resources"] | {"replica_label": "rack"},
        "train": job["train"] | {"global_batch": 6},
    }
    thread, outcome = through_cli(refused, cluster.address)
    thread.join()
    too_wide = job | {"parallel": {"dp": 1, "tp": 2}, "resources": job["resources"] | {"cpus_per_worker": 3}}  # 6 CPUs; nodes have 4 at most
    try:
        check_placement(spec_from_dict(too_wide))
    except UserError as err:
        results["too_wide"] = str(err)
    return results | {"refused": outcome["summary"]}


def main() -> None:
    jobs = json.loads(open(sys.argv[1]).read())
    began = time.perf_counter()
    seconds = {}  # each phase's wall time, in RESULT.json: where the suite's slowest test spends it

    def timed(name, run):
        start = time.perf_counter()
        result = run()
        seconds[name] = round(time.perf_counter() - start, 1)
        return result

    cluster, _ = start_cluster(worker_nodes=2, cpus_per_node=2)
    seconds["cluster"] = round(time.perf_counter() - began, 1)
    try:
        results = {
            "prepare": timed("prepare", lambda: prepare_dataset(PrepareOptions(**jobs["prepare"], show_progress=False)).model_dump(mode="json"))
        }
        results["placement"] = timed("placement", lambda: placement(jobs["placement"]))
        elastic = jobs["elastic"]
        results["whole"] = timed("whole", lambda: sdk.train(spec_from_dict(elastic | {"name": "whole"}), show_progress=False).as_json())
        results["shrunk"] = timed("shrunk", lambda: shrink_then_grow(cluster, elastic))
        results["spared"] = timed("spared", lambda: spared(cluster, elastic, jobs["spared_steps"]))
        results["topology"] = timed("topology", lambda: topology(cluster, jobs["placement"]))
        Path(sys.argv[2]).write_text(json.dumps(results | {"seconds": seconds}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
