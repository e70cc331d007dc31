"""`lmforge plan --serve` (`sdk.plan_serving`): what a serving replica of the job's model
holds, the weights and the KV cache of the sequences decoding together, and how many
full-context sequences fit a cluster's device beside the weights."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from pydantic import BaseModel, ConfigDict
from rich.console import Console
from rich.table import Table

from lmforge.errors import UserError
from lmforge.memory.serving import DTYPE_BYTES, ServingMemory, serving_memory
from lmforge.planner.cluster import Cluster, parse_cluster
from lmforge.planner.report import gib

if TYPE_CHECKING:
    from lmforge.spec import JobSpec


class ServingPlan(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    job: str
    dtype: str
    memory: ServingMemory
    cluster: Optional[Cluster] = None

    @property
    def sequences_per_device(self) -> Optional[int]:
        return self.memory.sequences_that_fit(self.cluster.gpu_mem) if self.cluster else None

    def show(self, console: Console) -> None:
        m = self.memory
        table = Table(title=f"{self.job}: one serving replica, {self.dtype} weights, {m.sequences} sequences of {m.context} positions")
        table.add_column("part")
        table.add_column("memory", justify="right")
        table.add_row("weights", gib(m.weights))
        table.add_row("KV cache, one sequence", gib(m.kv_per_sequence))
        table.add_row(f"KV cache, {m.sequences} sequences", gib(m.kv_cache))
        table.add_row("total", gib(m.total))
        console.print(table)
        if self.cluster is not None:
            fit = self.sequences_per_device
            console.print(
                f"a {self.cluster.gpu_mem / 1e9:g} GB device holds the weights and {fit} full-context sequences"
                if fit
                else f"a {self.cluster.gpu_mem / 1e9:g} GB device cannot hold the weights and one full-context sequence"
            )

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"job": self.job, "dtype": self.dtype, **self.memory.as_dict()}
        if self.cluster is not None:
            out["device_memory"], out["sequences_per_device"] = self.cluster.gpu_mem, self.sequences_per_device
        return out


def serving_plan(
    spec: JobSpec, sequences: int = 16, context: Optional[int] = None, dtype: str = "fp32", cluster: Optional[str] = None
) -> ServingPlan:
    if dtype not in DTYPE_BYTES:
        raise UserError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    if sequences < 1:
        raise UserError(f"--sequences: must be at least 1, got {sequences}")
    cfg = spec.model_arch
    if context is not None and not 0 < context <= cfg.max_seq_len:
        raise UserError(f"--context: must be 1..{cfg.max_seq_len} (the model's max_seq_len), got {context}")
    devices = parse_cluster(cluster) if cluster else None
    return ServingPlan(job=spec.name, dtype=dtype, memory=serving_memory(cfg, dtype, sequences, context), cluster=devices)
