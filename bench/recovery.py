"""Recovery from a lost node, lmforge against Ray Train V2, and the training stall
of an asynchronous checkpoint save against a synchronous one.

Recovery: a local cluster (`ray.cluster_utils.Cluster`: a 1-CPU head with the driver,
two 2-CPU worker nodes with one rank each) trains the same tiny model with dp 2,
checkpointing every 10 steps, first with lmforge (elastic dp 1..2) and then with
Ray Train V2's TorchTrainer (elastic `num_workers=(1, 2)`, `FailureConfig`). At the
same step one worker node is removed abruptly; the figure is the seconds from that
moment to the first step completed after the restore. The node is added back
between the two runs. lmforge reads its data through Ray Data; the Ray Train loop
uses in-memory batches, so data start-up is counted against lmforge only.

Stall: one rank saves the same model and AdamW state several times with
`checkpoint.async_save` on and off; the figure is the median of (a save plus the
training step after it) minus (the training step just before, without a save):
what a save costs the training loop, the background copy's contention included.

    python bench/recovery.py [--kill-at 20] [--stall-dim 512] [--stall-layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# This benchmark's Ray cluster keeps its sockets and logs to itself.
os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="lmf-bench-", dir="/tmp"))

import ray
import torch

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "chaos")]
from chaos import wait_until  # noqa: E402
from lmforge import sdk  # noqa: E402
from lmforge.checkpoint.state import TrainerState  # noqa: E402
from lmforge.data.corpus import stdlib_files  # noqa: E402
from lmforge.data.prepare import prepare_dataset  # noqa: E402
from lmforge.data.prepare_options import PrepareOptions  # noqa: E402
from lmforge.models.build import build_model  # noqa: E402
from lmforge.models.config import PRESETS  # noqa: E402
from lmforge.spec import spec_from_dict  # noqa: E402
from multinode import free_port, start_cluster  # noqa: E402

STEPS, INTERVAL, GLOBAL_BATCH, MICRO_BATCH, SEQ, VOCAB = 60, 10, 8, 2, 32, 512


def lmforge_job(out: Path, data: Path, in_memory: bool) -> dict:
    return {
        "name": "recovery",
        "output_dir": str(out),
        "model": {"preset": "tiny", "vocab_size": VOCAB},
        "parallel": {"dp": 2},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "decay_steps": STEPS},
        "train": {"global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH, "seq_len": SEQ, "max_steps": STEPS},
        "data": {"path": str(data)},
        "checkpoint": {"interval": INTERVAL, "in_memory": in_memory, "memory_interval": 1},
        "tracking": {"enabled": False},
        "resources": {"cpus_per_worker": 2},
        "fault_tolerance": {"max_failures": 3, "backoff_s": 0.1},
        "elastic": {"min_dp": 1, "max_dp": 2},
    }


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def lose_a_node(cluster, node, train, reached) -> float:
    """Train in a thread, remove `node` once `reached()`; returns the kill time."""
    errors: list = []

    def run():
        try:
            train()
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(reached)
    killed_at = time.time()
    cluster.remove_node(node, allow_graceful=False)  # Ray changes nodes from the main thread only
    thread.join()
    if errors:
        raise errors[0]
    return killed_at


def lmforge_recovery(cluster, node, out: Path, data: Path, kill_at: int, in_memory: bool) -> dict[str, float]:
    """Seconds from the kill to each phase's end, from the run's own events:
    detection (the failure event), re-form (the new layout), restore, first step."""
    run_dir = out / "recovery"
    spec = spec_from_dict(lmforge_job(out, data, in_memory))
    steps = lambda: [row for row in jsonl(run_dir / "metrics.jsonl") if "event" not in row]
    killed_at = lose_a_node(cluster, node, lambda: sdk.train(spec, show_progress=False), lambda: len(steps()) >= kill_at)
    after = [row for row in jsonl(run_dir / "metrics.jsonl") if row.get("time", 0) >= killed_at and "event" in row]
    at = lambda kind: next(row for row in after if row["event"] == kind)
    restored, recovered = at("restored"), at("recovered")
    return {
        "detection": at("failure")["time"] - killed_at,
        "re-form": at("layout")["time"] - killed_at,
        "restore": restored["time"] - killed_at,
        "first step": recovered["time"] - killed_at,
        "steps redone": recovered["steps_redone"],
        "from memory": restored.get("from_memory", False),
    }


def ray_train_loop(config: dict) -> None:
    """Ray Train's side: the same model and batch shapes, DDP over gloo, a checkpoint
    (model + AdamW) every INTERVAL steps; rank 0 logs starts and steps to a file."""
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model = ray.train.torch.prepare_model(build_model(PRESETS["tiny"].with_overrides(vocab_size=VOCAB), seed=0))
    plain = getattr(model, "module", model)  # DDP-wrapped only when world > 1
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = 0
    if checkpoint := ray.train.get_checkpoint():
        with checkpoint.as_directory() as directory:
            state = torch.load(os.path.join(directory, "state.pt"), weights_only=True)
        plain.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
    log = lambda row: rank == 0 and open(config["log"], "a").write(json.dumps(row | {"time": time.time()}) + "\n")
    log({"event": "start", "step": start, "world": world})
    accum = GLOBAL_BATCH // (MICRO_BATCH * world)
    for step in range(start, STEPS):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
        share = tokens.view(world, accum, MICRO_BATCH, SEQ + 1)[rank]
        for micro in share:
            logits = model(micro[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), micro[:, 1:].flatten()) / accum
            loss.backward()
        opt.step()
        opt.zero_grad()
        log({"event": "step", "step": step + 1, "world": world})
        if (step + 1) % INTERVAL == 0:
            with tempfile.TemporaryDirectory() as directory:
                if rank == 0:
                    torch.save({"model": plain.state_dict(), "optim": opt.state_dict(), "step": step + 1}, os.path.join(directory, "state.pt"))
                ray.train.report({"step": step + 1}, checkpoint=ray.train.Checkpoint.from_directory(directory) if rank == 0 else None)


def ray_train_recovery(cluster, node, out: Path, kill_at: int) -> dict[str, float]:
    """Ray Train's loop logs only its starts and steps: the restart (its re-form and
    restore together) and the first step."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out.mkdir(parents=True, exist_ok=True)
    log = out / "ray-train.jsonl"
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config={"log": str(log)},
        scaling_config=ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 2}),
        run_config=RunConfig(name="recovery", storage_path=str(out / "ray-train"), failure_config=FailureConfig(max_failures=3)),
    )
    reached = lambda: sum(row["event"] == "step" for row in jsonl(log)) >= kill_at
    killed_at = lose_a_node(cluster, node, trainer.fit, reached)
    rows = [row for row in jsonl(log) if row["time"] > killed_at]
    restart = next(i for i, row in enumerate(rows) if row["event"] == "start")
    first_step = next(row for row in rows[restart:] if row["event"] == "step")
    return {
        "restore": rows[restart]["time"] - killed_at,
        "first step": first_step["time"] - killed_at,
        "steps redone": max(row["step"] for row in rows[:restart] if row["event"] == "step") + 1 - first_step["step"] if restart else 0,
    }


@ray.remote(num_cpus=0)
class _Controller:
    def snapshot_taken(self, step: int, world: int, attempt: int) -> None:
        pass


def save_stall(dim: int, layers: int, saves: int) -> dict[str, float]:
    """Median seconds the loop is held up per save (sync, async, an in-memory
    snapshot), on one rank."""
    import torch.distributed as dist

    from lmforge.checkpoint.memory import SnapshotWriter
    from lmforge.checkpoint.store import CheckpointStore
    from lmforge.checkpoint.writer import CheckpointWriter
    from lmforge.cluster.keepers import Keeper, SnapshotShipper
    from lmforge.engines import create_engine
    from lmforge.parallel.mesh import build_mesh
    from lmforge.parallel.shape import MeshShape

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    spec = spec_from_dict(
        {
            "name": "stall",
            "model": {"preset": "small", "dim": dim, "n_layers": layers, "ffn_hidden": 4 * dim, "vocab_size": 8192},
            "parallel": {"dp": 1, "zero": 0},
            "train": {"global_batch": 2, "micro_batch": 2, "seq_len": 64, "max_steps": 1},
            "data": {"path": "unused"},
        }
    )
    engine = create_engine(spec, build_mesh("cpu", MeshShape.for_spec(spec.parallel)), torch.device("cpu"))
    engine.train_step(torch.randint(0, 8192, (1, 2, 65)))  # AdamW state exists from here on
    group = dist.new_group(backend="gloo")
    batch = lambda: torch.randint(0, 8192, (1, 2, 65))
    stalls: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "async", "snapshot"):
            options = spec.checkpoint.model_copy(update={"async_save": mode == "async", "keep": 1})
            if mode == "snapshot":  # to a real keeper, through Ray's object store as a job's ranks ship them
                ray.init(num_cpus=1, include_dashboard=False)
                writer = SnapshotWriter(SnapshotShipper([Keeper.remote()], _Controller.remote(), 0), group)
            else:
                writer = CheckpointWriter(CheckpointStore(f"{tmp}/{mode}"), options, group, lambda event: None)
            held, alone_times = [], []
            for i in range(saves):
                began = time.perf_counter()
                engine.train_step(batch())
                alone = time.perf_counter() - began
                alone_times.append(alone)
                began = time.perf_counter()
                writer.save(i + 1, engine, TrainerState(step=i + 1))
                engine.train_step(batch(), before_update=writer.staged)
                held.append(time.perf_counter() - began - alone)
                writer.wait()  # the write finishes before the next round (not counted)
            writer.close()
            if mode == "snapshot":
                ray.shutdown()
            stalls[mode] = statistics.median(held[1:])  # the first save also allocates the stager's buffers
            stalls.setdefault("step", statistics.median(alone_times))
    stalls["state_mib"] = spec.model_arch.num_params() * 4 * 3 / 2**20  # fp32 weights and two AdamW moments
    dist.destroy_process_group()
    return stalls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kill-at", type=int, default=20, help="steps completed before the node is removed")
    parser.add_argument("--stall-dim", type=int, default=512)
    parser.add_argument("--stall-layers", type=int, default=8)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1, help="node losses per side, interleaved")
    parser.add_argument("--no-stall", action="store_true", help="skip the checkpoint stall part")
    parser.add_argument("--no-ray-train", action="store_true", help="skip Ray Train V2 (no ratio)")
    parser.add_argument("--no-recovery", action="store_true", help="only the checkpoint stall part")
    args = parser.parse_args()

    if not args.no_stall:
        stall = save_stall(args.stall_dim, args.stall_layers, args.saves)
        print(
            f"checkpoint stall, one rank, {stall['state_mib']:.0f} MiB of model + AdamW state, median of {args.saves - 1} saves "
            f"(a training step alone: {stall['step'] * 1000:.0f} ms)"
        )
        print(f"  synchronous save : {stall['sync'] * 1000:8.1f} ms held up")
        print(f"  async save       : {stall['async'] * 1000:8.1f} ms held up")
        print(f"  ratio async / sync: {stall['async'] / stall['sync']:.3f}  (target <= 0.05)")
        print(
            f"  in-memory snapshot: {stall['snapshot'] * 1000:8.1f} ms held up (checkpoint.in_memory, once per memory_interval; "
            f"ratio to sync {stall['snapshot'] / stall['sync']:.3f})"
        )
    if args.no_recovery:
        return

    runs: dict[str, list] = {"lmforge, in-memory": [], "lmforge, storage": [], "Ray Train V2": []}
    with tempfile.TemporaryDirectory(prefix="lmf-recovery-") as tmp:
        out = Path(tmp)
        corpus = out / "corpus"
        corpus.mkdir()
        for i, path in enumerate([f for f in stdlib_files() if "/test" not in f][::40][:40]):
            (corpus / f"{i:03d}.py").write_text(Path(path).read_text(errors="replace"))
        cluster, workers = start_cluster(worker_nodes=2, cpus_per_node=2)
        try:
            prepare_dataset(PrepareOptions(source=str(corpus), out=str(out / "data"), seq_len=SEQ, vocab_size=VOCAB, show_progress=False))
            for repeat in range(args.repeats):
                for side in runs:
                    if side == "Ray Train V2" and args.no_ray_train:
                        continue
                    where = out / f"{repeat}-{side.split(',')[-1].strip().replace(' ', '-')}"
                    if side == "Ray Train V2":
                        runs[side].append(ray_train_recovery(cluster, workers[1], where, args.kill_at))
                    else:
                        runs[side].append(lmforge_recovery(cluster, workers[1], where, out / "data", args.kill_at, side.endswith("in-memory")))
                    print(side, {k: round(v, 2) if isinstance(v, float) else v for k, v in runs[side][-1].items()}, flush=True)
                    workers[1] = cluster.add_node(num_cpus=2)
                    cluster.wait_for_nodes()
        finally:
            ray.shutdown()
            cluster.shutdown()
    report(runs, args.kill_at)


def report(runs: dict[str, list], kill_at: int) -> None:
    print(
        f"recovery after a node loss at step {kill_at} (dp 2 -> 1, tiny model, checkpoint every {INTERVAL} steps; "
        "seconds from the kill to the end of each phase, median of the repeats)"
    )
    phases = ["detection", "re-form", "restore", "first step"]
    print(f"  {'':20s}" + "".join(f"{phase:>12s}" for phase in phases) + "  steps redone")
    median = {
        side: {k: statistics.median(run[k] for run in rows) for k in rows[0] if k in phases + ["steps redone"]} for side, rows in runs.items() if rows
    }
    for side, m in median.items():
        cells = "".join(f"{m[phase]:12.1f}" if phase in m else f"{'-':>12s}" for phase in phases)
        print(f"  {side:20s}{cells}  {m.get('steps redone', '-')}")
    theirs = median.get("Ray Train V2", {}).get("first step")
    for side, target in (("lmforge, in-memory", 6.0), ("lmforge, storage", 10.0)):
        ours = median[side]["first step"]
        spread = [run["first step"] for run in runs[side]]
        line = f"  {side}: {ours:.1f} s (target <= {target:g} s; repeats {min(spread):.1f}-{max(spread):.1f})"
        if theirs:
            line += f", ratio to Ray Train V2 {ours / theirs:.3f} (target <= 0.125)"
        print(line)


if __name__ == "__main__":
    main()
