"""`lmforge plan JOB`: the job's per-rank memory (table, chart, JSON) and, with
`--search`, the layouts that fit a cluster ranked by the step-time model."""

from __future__ import annotations

import json
from pathlib import Path

from lmforge.errors import UserError
from lmforge.memory.chart import bar_chart
from lmforge.memory.estimate import stage_peaks, worst_rank
from lmforge.memory.snapshots import COPIES, snapshot_bytes
from lmforge.planner.cluster import Cluster, assumed_cluster, parse_cluster
from lmforge.planner.report import fits, gib, render, search_reasons, search_table
from lmforge.planner.search import Candidate, search
from lmforge.planner.throughput import step_time
from lmforge.spec import JobSpec, load_spec
from lmforge.tracking.console import text_console


def plan(args) -> int:
    if args.top < 1:
        raise UserError(f"--top: must be at least 1, got {args.top}")
    cluster = parse_cluster(args.cluster) if args.cluster else None
    spec = load_spec(args.job, args.overrides)
    if args.search:
        return _search(spec, cluster or assumed_cluster(spec.world_size), args, assumed=cluster is None)
    breakdown = worst_rank(spec)
    chart = None if args.no_chart else _chart_path(args, spec)
    if chart:
        limits = {} if cluster is None else {"device memory": cluster.gpu_mem, "usable": cluster.usable}
        bars = [(f"stage {i} (rank {b.rank})", b) for i, b in enumerate(stage_peaks(spec))]
        bar_chart(chart, f"{spec.name}: largest rank of each pipeline stage", bars, limits)
    if args.json:
        out = {"job": spec.name, "world_size": spec.world_size, "worst_rank": breakdown.as_dict(), "chart": str(chart) if chart else None}
        if spec.checkpoint.in_memory:
            out["in_memory_host_bytes_per_rank"] = COPIES * snapshot_bytes(breakdown)
        if cluster is not None:
            out["cluster"] = _cluster_dict(cluster) | {"fits": fits(breakdown, cluster)}
        print(json.dumps(out, indent=2))
        return 0
    console = text_console(stderr=False)
    render(spec.name, breakdown, spec.world_size, cluster, console)
    if spec.checkpoint.in_memory:
        console.print(
            f"in-memory checkpoints (checkpoint.in_memory): {gib(snapshot_bytes(breakdown))} per snapshot of this rank, "
            f"kept {COPIES} times (its node and a replica, the last snapshot and the one being taken): "
            f"{gib(COPIES * snapshot_bytes(breakdown))} of host memory per rank"
        )
    if chart:
        console.print(f"chart: {chart}")
    return 0


def _search(spec: JobSpec, cluster: Cluster, args, assumed: bool) -> int:
    console = text_console(stderr=args.json)
    if assumed:
        console.print(f"cluster: {cluster.describe()}, assumed from the job's {spec.world_size} ranks (give --cluster to change)")
    console.print(f"weighing the layouts of {spec.name} on {cluster.gpus} GPUs ...")
    candidates = search(spec, cluster)
    if not candidates:
        raise UserError(
            f"--cluster: no layout of {spec.name} fits {cluster.describe()} "
            f"({cluster.usable / 2**30:.1f} GiB usable per device); add devices or shrink train.seq_len or the model"
        )
    own = _own_layout(spec, cluster, candidates)
    chart = None if args.no_chart else _chart_path(args, spec, "memory-search.png")
    if chart:
        bars = [(f"#{i} {c.short}", c.memory) for i, c in enumerate(candidates[: args.top], 1)]
        bar_chart(
            chart,
            f"{spec.name}: largest rank of the best layouts on {cluster.describe()}",
            bars,
            {"device memory": cluster.gpu_mem, "usable": cluster.usable},
        )
    if args.json:
        print(
            json.dumps(
                {
                    "job": spec.name,
                    "cluster": _cluster_dict(cluster),
                    "layouts_that_fit": len(candidates),
                    "best": [c.as_dict() for c in candidates[: args.top]],
                    "job_layout": own,
                    "chart": str(chart) if chart else None,
                },
                indent=2,
            )
        )
        return 0
    console.print(search_table(candidates, cluster, args.top))
    for line in search_reasons(candidates, cluster, args.top):
        console.print(line)
    console.print(
        f"best: {candidates[0].layout}; to train with it: " + " ".join(f"--set {item}" for item in candidates[0].overrides()), soft_wrap=True
    )  # one line, to copy whole
    console.print(_own_line(own))
    if chart:
        console.print(f"chart: {chart}")
    return 0


def _own_layout(spec: JobSpec, cluster: Cluster, candidates: list[Candidate]) -> dict:
    """Where the job's own layout stands among the candidates."""
    peak = worst_rank(spec)
    out = {"fits": fits(peak, cluster), "peak_bytes": peak.device_total, "uses_gpus": spec.world_size}
    if spec.world_size == cluster.gpus and spec.engine == "native":
        seconds = step_time(spec, cluster).total
        out |= {
            "step_seconds": seconds,
            "rank": 1 + sum(c.time.total < seconds for c in candidates),
            "slower_than_best": seconds / candidates[0].time.total - 1,
        }
    return out


def _own_line(own: dict) -> str:
    line = f"the job's own layout: {own['peak_bytes'] / 2**30:.1f} GiB peak, {'fits' if own['fits'] else 'does NOT fit'}"
    if "rank" in own:
        line += f", ranks #{own['rank']} ({own['slower_than_best']:+.0%} step time against the best)"
    else:
        line += f" (it uses {own['uses_gpus']} GPUs, so it is not ranked)"
    return line


def _chart_path(args, spec: JobSpec, name: str = "memory-plan.png") -> Path:
    return Path(args.chart) if args.chart else Path(spec.run_dir) / name


def _cluster_dict(cluster: Cluster) -> dict:
    return {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node, "gpu_mem": cluster.gpu_mem, "usable": cluster.usable}
