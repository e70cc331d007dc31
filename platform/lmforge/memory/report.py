"""`lmforge plan`: the per-rank memory breakdown of a job as a table or JSON, and
whether it fits the devices of a cluster given as "nodes=4,gpus_per_node=8,gpu_mem=80GB"."""

from __future__ import annotations

import re
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from lmforge.errors import UserError
from lmforge.memory.estimate import Breakdown

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_mem: int  # bytes

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def parse_cluster(text: str) -> Cluster:
    """"nodes=4,gpus_per_node=8,gpu_mem=80GB" -> Cluster; UserError naming --cluster."""
    fields = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in ("nodes", "gpus_per_node", "gpu_mem"):
            raise UserError(f"--cluster: cannot read {item!r}; expected nodes=N,gpus_per_node=G,gpu_mem=80GB")
        fields[key.strip()] = value.strip()
    missing = [key for key in ("nodes", "gpus_per_node", "gpu_mem") if key not in fields]
    if missing:
        raise UserError(f"--cluster: {', '.join(missing)} missing; expected nodes=N,gpus_per_node=G,gpu_mem=80GB")
    counts = {}
    for key in ("nodes", "gpus_per_node"):
        if not fields[key].isdigit() or int(fields[key]) == 0:
            raise UserError(f"--cluster: {key} must be a whole number above 0, got {fields[key]!r}")
        counts[key] = int(fields[key])
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)", fields["gpu_mem"])
    if not match or match.group(2).upper() not in UNITS:
        raise UserError(f"--cluster: gpu_mem {fields['gpu_mem']!r} is not a size such as 80GB or 141GiB")
    size = int(float(match.group(1)) * UNITS[match.group(2).upper()])
    if size <= 0:
        raise UserError("--cluster: gpu_mem must be above 0")
    return Cluster(counts["nodes"], counts["gpus_per_node"], size)


def gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


ROWS = [("parameters", "params"), ("gradients", "grads"), ("optimizer states", "optimizer"),
        ("activations (in flight)", "activations"), ("temporary (logits, gathered params)", "temporary")]


def render(job: str, breakdown: Breakdown, world: int, cluster: Cluster | None, console: Console) -> None:
    table = Table(title=f"{job}: memory of rank {breakdown.rank} (the largest of {world})")
    table.add_column("")
    table.add_column("device", justify="right")
    for label, key in ROWS:
        table.add_row(label, gib(getattr(breakdown, key)))
    table.add_row("total", gib(breakdown.device_total), style="bold")
    if breakdown.host:
        table.add_row("offloaded to host memory", gib(breakdown.host))
    console.print(table)
    if cluster is not None:
        verdict = "fits" if fits(breakdown, cluster) else "does NOT fit"
        console.print(f"{verdict} in {gib(cluster.gpu_mem)} per device ({cluster.gpus} devices; the job uses {world})")


def fits(breakdown: Breakdown, cluster: Cluster) -> bool:
    return breakdown.device_total <= cluster.gpu_mem
