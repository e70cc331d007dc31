"""What `lmforge plan` prints: a rank's memory breakdown as a table, whether it
fits a cluster's devices, and the ranked layouts of a search."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from lmforge.memory.estimate import Breakdown
from lmforge.planner.cluster import Cluster
from lmforge.planner.search import Candidate

ROWS = [
    ("parameters", "params"),
    ("gradients", "grads"),
    ("optimizer states", "optimizer"),
    ("activations (in flight)", "activations"),
    ("temporary (logits, gathered params)", "temporary"),
]


def gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def fits(breakdown: Breakdown, cluster: Cluster) -> bool:
    return breakdown.device_total <= cluster.usable


def breakdown_table(title: str, breakdown: Breakdown) -> Table:
    table = Table(title=title)
    table.add_column("")
    table.add_column("device", justify="right")
    for label, key in ROWS:
        table.add_row(label, gib(getattr(breakdown, key)))
    if breakdown.teacher:
        table.add_row("teacher weights (distillation, frozen)", gib(breakdown.teacher))
    table.add_row("total", gib(breakdown.device_total), style="bold")
    if breakdown.host:
        table.add_row("offloaded to host memory", gib(breakdown.host))
    if breakdown.disk:
        table.add_row("offloaded to NVMe (disk)", gib(breakdown.disk))
    return table


def verdict(breakdown: Breakdown, cluster: Cluster, world: int) -> str:
    word = "fits" if fits(breakdown, cluster) else "does NOT fit"
    return (
        f"{word}: {gib(breakdown.device_total)} of the {gib(cluster.usable)} usable per device "
        f"({cluster.gpu_mem / 1e9:g} GB less a reserve; {cluster.gpus} devices, the job uses {world})"
    )


def render(job: str, breakdown: Breakdown, world: int, cluster: Cluster | None, console: Console) -> None:
    console.print(breakdown_table(f"{job}: memory of rank {breakdown.rank} (the largest of {world})", breakdown))
    if cluster is not None:
        console.print(verdict(breakdown, cluster, world))


def search_table(candidates: list[Candidate], cluster: Cluster, top: int) -> Table:
    """The best `top` layouts; their reasons go below it (`search_reasons`), where a
    narrow terminal cannot squeeze them to nothing."""
    best = candidates[0].time.total
    table = Table(title=f"best {min(top, len(candidates))} of {len(candidates)} layouts that fit {cluster.describe()}")
    for column in ("#", "layout", "peak", "step", "tok/s/GPU", "MFU"):
        table.add_column(column, justify="left" if column == "layout" else "right", no_wrap=True)
    for rank, c in enumerate(candidates[:top], 1):
        slower = "" if rank == 1 else f" (+{c.time.total / best - 1:.0%})"
        table.add_row(
            str(rank), c.short, gib(c.memory.device_total), f"{c.time.total:.2f} s{slower}", f"{c.tokens_per_s_per_gpu:,.0f}", f"{c.mfu:.0%}"
        )
    return table


def search_reasons(candidates: list[Candidate], cluster: Cluster, top: int) -> list[str]:
    """Why each of the best `top` costs what it does (shares of its step)."""
    return [f"#{rank} {c.short}: {c.reason(cluster)}" for rank, c in enumerate(candidates[:top], 1)]
