"""`sdk.plan` and `sdk.search_layouts` (what `lmforge plan` calls): the job's per-rank
memory (`MemoryPlan`) and the layouts that fit a cluster ranked by the step-time
model (`LayoutSearch`), each shown as `lmforge plan` prints it or as its JSON."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from pydantic import BaseModel, ConfigDict
from rich.console import Console

from lmforge.errors import UserError
from lmforge.memory.chart import bar_chart
from lmforge.memory.estimate import Breakdown, stage_peaks, worst_rank
from lmforge.memory.snapshots import COPIES, snapshot_bytes
from lmforge.memory.states import lora_parameters
from lmforge.planner.cluster import Cluster, assumed_cluster, parse_cluster
from lmforge.planner.report import fits, gib, render, search_reasons, search_table
from lmforge.planner.search import Candidate, search
from lmforge.planner.throughput import step_time

if TYPE_CHECKING:
    from lmforge.spec import JobSpec


class MemoryPlan(BaseModel):
    """The job's fullest rank, by part, and whether it fits the cluster asked about."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    job: str
    world_size: int
    breakdown: Breakdown
    cluster: Optional[Cluster] = None
    chart: Optional[str] = None
    in_memory_host_bytes_per_rank: Optional[int] = None  # with checkpoint.in_memory: the snapshots' host memory
    lora_rank: Optional[int] = None  # with model.lora: its rank, the adapters' parameters, and the model's
    trainable_parameters: Optional[int] = None
    model_parameters: Optional[int] = None

    @property
    def worst_rank(self) -> dict[str, int]:
        return self.breakdown.as_dict()

    @property
    def fits(self) -> Optional[bool]:
        return fits(self.breakdown, self.cluster) if self.cluster else None

    def show(self, console: Console) -> None:
        """As `lmforge plan` prints it: the table, the verdict, the snapshots' host memory."""
        render(self.job, self.breakdown, self.world_size, self.cluster, console)
        if self.trainable_parameters is not None and self.model_parameters:
            console.print(
                f"LoRA (model.lora, rank {self.lora_rank}): {self.trainable_parameters:,} trainable parameters of the model's "
                f"{self.model_parameters:,} ({self.trainable_parameters / self.model_parameters:.2%}); the gradients and optimizer "
                "states above are theirs alone"
            )
        if self.in_memory_host_bytes_per_rank is not None:
            console.print(
                f"in-memory checkpoints (checkpoint.in_memory): {gib(snapshot_bytes(self.breakdown))} per snapshot of this rank, "
                f"kept {COPIES} times (its node and a replica, the last snapshot and the one being taken): "
                f"{gib(self.in_memory_host_bytes_per_rank)} of host memory per rank"
            )
        if self.chart:
            console.print(f"chart: {self.chart}")

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"job": self.job, "world_size": self.world_size, "worst_rank": self.worst_rank, "chart": self.chart}
        if self.in_memory_host_bytes_per_rank is not None:
            out["in_memory_host_bytes_per_rank"] = self.in_memory_host_bytes_per_rank
        if self.trainable_parameters is not None:
            out["lora"] = {"rank": self.lora_rank, "trainable_parameters": self.trainable_parameters, "model_parameters": self.model_parameters}
        if self.cluster is not None:
            out["cluster"] = _cluster_dict(self.cluster) | {"fits": self.fits}
        return out


class LayoutSearch(BaseModel):
    """The layouts of a job that fit a cluster, fastest first, and where its own stands."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    job: str
    cluster: Cluster
    candidates: list[Candidate]
    top: int
    job_layout: dict[str, Any]
    assumed: bool  # no cluster was given: the job's world size in 8 x 80 GB nodes
    chart: Optional[str] = None

    @property
    def best(self) -> list[Candidate]:
        return self.candidates[: self.top]

    @property
    def offloaded(self) -> bool:
        """Nothing fits the devices: these layouts keep the model states in host memory."""
        return self.candidates[0].spec.parallel.cpu_offload

    def show_assumption(self, console: Console) -> None:
        if self.assumed:
            console.print(f"cluster: {self.cluster.describe()}, assumed from the job's {self.cluster.gpus} ranks (give --cluster to change)")

    def show(self, console: Console) -> None:
        """As `lmforge plan --search` prints it: the best layouts, why, and the job's own."""
        self.show_assumption(console)
        if self.offloaded:
            console.print(
                f"no layout fits {self.cluster.gpu_mem / 1e9:g} GB devices as it is; with CPU offload (parallel.cpu_offload: "
                "parameters, gradients and optimizer state in host memory, copied in for each pass) these do:"
            )
        console.print(search_table(self.candidates, self.cluster, self.top))
        for line in search_reasons(self.candidates, self.cluster, self.top):
            console.print(line)
        best = self.candidates[0]
        console.print(
            f"best: {best.layout}; to train with it: " + " ".join(f"--set {item}" for item in best.overrides()), soft_wrap=True
        )  # one line, to copy whole
        console.print(_own_line(self.job_layout))
        if self.chart:
            console.print(f"chart: {self.chart}")

    def as_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "cluster": _cluster_dict(self.cluster),
            "layouts_that_fit": len(self.candidates),
            "cpu_offload": self.offloaded,
            "best": [c.as_dict() for c in self.best],
            "job_layout": self.job_layout,
            "chart": self.chart,
        }


def cluster_of(spec: JobSpec, cluster: Optional[str], searching: bool) -> Optional[Cluster]:
    """The cluster asked about ("nodes=4,gpus_per_node=8,gpu_mem=80GB"); a search without
    one assumes the job's world size in 8 x 80 GB nodes."""
    if cluster:
        return parse_cluster(cluster)
    return assumed_cluster(spec.world_size) if searching else None


def memory_plan(spec: JobSpec, cluster: Optional[str] = None, chart: Optional[str | Path] = None) -> MemoryPlan:
    """The job's largest rank's memory by part; with `chart`, a PNG of each pipeline stage's largest rank."""
    devices = cluster_of(spec, cluster, searching=False)
    breakdown = worst_rank(spec)
    if chart:
        limits = {} if devices is None else {"device memory": devices.gpu_mem, "usable": devices.usable}
        bars = [(f"stage {i} (rank {b.rank})", b) for i, b in enumerate(stage_peaks(spec))]
        bar_chart(Path(chart), f"{spec.name}: largest rank of each pipeline stage", bars, limits)
    return MemoryPlan(
        job=spec.name,
        world_size=spec.world_size,
        breakdown=breakdown,
        cluster=devices,
        chart=str(chart) if chart else None,
        in_memory_host_bytes_per_rank=COPIES * snapshot_bytes(breakdown) if spec.checkpoint.in_memory else None,
        **_lora_counts(spec),
    )


def _lora_counts(spec: JobSpec) -> dict[str, int]:
    lora = spec.model.lora
    if lora is None:
        return {}
    return {"lora_rank": lora.rank, "trainable_parameters": lora_parameters(spec.model_arch, lora), "model_parameters": spec.model_arch.num_params()}


def layout_search(spec: JobSpec, cluster: Optional[str] = None, top: int = 5, chart: Optional[str | Path] = None) -> LayoutSearch:
    """The layouts of the job's model and batch that fit `cluster`, ranked by the step-time model."""
    if top < 1:
        raise UserError(f"--top: must be at least 1, got {top}")
    devices = cluster_of(spec, cluster, searching=True)
    assert devices is not None  # a search always has one
    candidates = search(spec, devices)
    if not candidates:
        raise UserError(
            f"--cluster: no layout of {spec.name} fits {devices.describe()} "
            f"({devices.usable / 2**30:.1f} GiB usable per device), CPU offload included; add devices or shrink train.seq_len or the model, "
            "or keep the states on disk with DeepSpeed ZeRO-3's NVMe offload (engine: deepspeed; `lmforge plan` of that job counts them)"
        )
    if chart:
        bars = [(f"#{i} {c.short}", c.memory) for i, c in enumerate(candidates[:top], 1)]
        bar_chart(
            Path(chart),
            f"{spec.name}: largest rank of the best layouts on {devices.describe()}",
            bars,
            {"device memory": devices.gpu_mem, "usable": devices.usable},
        )
    return LayoutSearch(
        job=spec.name,
        cluster=devices,
        candidates=candidates,
        top=top,
        job_layout=_own_layout(spec, devices, candidates),
        assumed=not cluster,
        chart=str(chart) if chart else None,
    )


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


def _cluster_dict(cluster: Cluster) -> dict:
    return {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node, "gpu_mem": cluster.gpu_mem, "usable": cluster.usable}
