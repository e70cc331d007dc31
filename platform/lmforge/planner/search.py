"""The layouts a job could run with on a cluster, those whose largest rank fits the
device, ranked by the step-time model.

Every GPU is used. Searched: tp (dividing a node's GPUs, so a TP group stays on one
node), pp, dp (what is left), zero 0/2/3, activation checkpointing (none, op-level
selective, full) and the micro-batch; the job's global batch, sequence length,
precision and model stay as they are. The pipeline schedule is the job's when it
is valid for the layout, else 1F1B. A layout the job's own rules reject (heads not
divisible by tp, fewer micro-batches than stages, ...) is not a candidate. When no
layout fits, the same layouts with CPU offload (parameters, gradients and optimizer
state in host memory) are weighed, each needing its states to fit the node's host
memory; NVMe offload is the deepspeed engine's, which this search does not plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from pydantic import ValidationError

from lmforge.errors import UserError
from lmforge.memory.estimate import Breakdown, worst_rank
from lmforge.planner.cluster import Cluster
from lmforge.planner.throughput import StepTime, model_flops_utilization, step_time, tokens_per_second_per_gpu
from lmforge.spec import JobSpec

CHECKPOINTING = (("none", None), ("selective", "op"), ("full", None))
MAX_MICRO_BATCH = 16
OVERHEAD_NAMES = {
    "recompute": "recompute",
    "bubble": "bubble",
    "tp_comm": "TP comm",
    "dp_comm": "DP comm",
    "pp_comm": "PP comm",
    "offload": "CPU offload",
}


@dataclass(frozen=True)
class Candidate:
    spec: JobSpec
    memory: Breakdown  # the largest rank's
    time: StepTime
    tokens_per_s_per_gpu: float
    mfu: float

    @property
    def layout(self) -> str:
        p = self.spec.parallel
        ac = {"none": "no AC", "full": "full AC"}.get(p.activation_checkpointing, f"selective AC ({p.ac_every})")
        schedule = f" {p.schedule}" if p.pp > 1 else ""
        offload = ", CPU offload" if p.cpu_offload else ""
        return f"tp {p.tp} pp {p.pp}{schedule} dp {p.dp}, zero {p.zero}, {ac}{offload}, micro-batch {self.spec.train.micro_batch}"

    @property
    def short(self) -> str:
        p = self.spec.parallel
        ac = {"none": "", "full": " AC full"}.get(p.activation_checkpointing, f" AC {p.ac_every}")
        return f"tp{p.tp} pp{p.pp} dp{p.dp} z{p.zero}{ac}{' offload' if p.cpu_offload else ''} mb{self.spec.train.micro_batch}"

    def reason(self, cluster: Cluster) -> str:
        """What the step spends beyond compute, largest first, and the memory margin."""
        costs = sorted(self.time.overheads().items(), key=lambda kv: -kv[1])
        shown = [f"{OVERHEAD_NAMES[name]} {share:.0%}" for name, share in costs if share >= 0.005]
        if self.time.dp_hidden >= 0.005 * self.time.total:
            shown.append(f"DP comm {self.time.dp_hidden:.2f} s hidden under backward")
        memory = f"{1 - self.memory.device_total / cluster.usable:.0%} memory to spare"
        if self.spec.parallel.cpu_offload:
            memory += f", {self.memory.host / 2**30:.1f} GiB of host memory per rank"
        return ", ".join(shown or ["no modelled overhead"]) + f"; {memory}"

    def overrides(self) -> list[str]:
        """The `--set` items that give the job this layout."""
        p = self.spec.parallel
        items = [f"parallel.{k}={getattr(p, k)}" for k in ("tp", "pp", "dp", "zero", "activation_checkpointing")]
        if p.cpu_offload:
            items += ["parallel.cpu_offload=true", f"resources.gpus_per_worker={self.spec.resources.gpus_per_worker:g}"]
        if p.activation_checkpointing == "selective":
            items.append(f"parallel.ac_every={p.ac_every}")
        if p.pp > 1:
            items += [f"parallel.schedule={p.schedule}", f"parallel.virtual_stages={p.virtual_stages}"]
        return items + [f"parallel.sequence_parallel={str(p.sequence_parallel).lower()}", f"train.micro_batch={self.spec.train.micro_batch}"]

    @property
    def layout_key(self) -> tuple[str, ...]:
        """The layout without its micro-batch: what the ranking lists once."""
        return tuple(item for item in self.overrides() if not item.startswith("train.micro_batch="))

    def as_dict(self) -> dict:
        p = self.spec.parallel
        return {
            "tp": p.tp,
            "pp": p.pp,
            "dp": p.dp,
            "zero": p.zero,
            "schedule": p.schedule,
            "activation_checkpointing": p.activation_checkpointing,
            "ac_every": p.ac_every,
            "cpu_offload": p.cpu_offload,
            "host_bytes": self.memory.host,
            "micro_batch": self.spec.train.micro_batch,
            "peak_bytes": self.memory.device_total,
            "step_seconds": self.time.total,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "overheads": self.time.overheads(),
            "dp_comm_hidden_seconds": self.time.dp_hidden,
            "overrides": self.overrides(),
        }


def search(spec: JobSpec, cluster: Cluster) -> list[Candidate]:
    """Every layout that fits, fastest first (ties: less memory first), each with its
    best micro-batch: where the model finds micro-batches equally fast, the smallest
    footprint, so the ranking shows distinct layouts rather than one layout many times.
    Where none fits, those that do with CPU offload."""
    if spec.engine != "native":
        raise UserError("--search: plans layouts for engine: native (the deepspeed engine runs data parallelism only)")
    return _ranked(spec, cluster, offload=False) or _ranked(spec, cluster, offload=True)


def _ranked(spec: JobSpec, cluster: Cluster, offload: bool) -> list[Candidate]:
    best: dict[tuple, Candidate] = {}
    for candidate in _layouts(spec, cluster, offload):
        memory = worst_rank(candidate)
        if memory.device_total > cluster.usable or memory.host > cluster.usable_host_per_gpu:
            continue
        time = step_time(candidate, cluster)
        found = Candidate(candidate, memory, time, tokens_per_second_per_gpu(candidate, time), model_flops_utilization(candidate, time, cluster))
        key = found.layout_key
        if key not in best or _order(found) < _order(best[key]):
            best[key] = found
    return sorted(best.values(), key=_order)


def _order(c: Candidate) -> tuple[float, int]:
    return c.time.total, c.memory.device_total


def _layouts(spec: JobSpec, cluster: Cluster, offload: bool) -> Iterator[JobSpec]:
    base = spec.model_dump(mode="json", exclude_unset=True)
    base.get("resources", {}).pop("workers", None)
    if offload:  # offloads from GPU memory: each rank holds one GPU
        base["resources"] = base.get("resources", {}) | {"gpus_per_worker": max(1.0, spec.resources.gpus_per_worker)}
    base.pop("elastic", None)  # a plan is for one size; elastic bounds are the job's own choice
    world, train = cluster.gpus, spec.train
    for tp in _divisors(cluster.gpus_per_node):
        for pp in _divisors(world // tp) if world % tp == 0 else ():
            dp = world // (tp * pp)
            for micro in (mb for mb in _divisors(MAX_MICRO_BATCH) if train.global_batch % (mb * dp) == 0):
                for zero in (0, 2, 3) if dp > 1 else (0,):  # nothing to shard over one replica
                    for mode, every in CHECKPOINTING:
                        layout = _valid(base, _parallel(spec, tp, pp, dp, zero, mode, every, offload), micro)
                        if layout is not None:
                            yield layout


def _parallel(spec: JobSpec, tp: int, pp: int, dp: int, zero: int, mode: str, every, offload: bool) -> dict:
    parallel = {
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "zero": zero,
        "dp_replicate": 1,
        "cpu_offload": offload,
        "sequence_parallel": tp > 1,
        "activation_checkpointing": mode,
        "compile": spec.parallel.compile,
    }
    if every is not None:
        parallel["ac_every"] = every
    schedule = spec.parallel.schedule if pp > 1 else "1f1b"
    parallel["schedule"], parallel["virtual_stages"] = schedule, spec.parallel.virtual_stages if pp > 1 else 1
    return parallel


def _valid(base: dict, parallel: dict, micro_batch: int) -> JobSpec | None:
    tree = base | {"parallel": parallel, "train": base.get("train", {}) | {"micro_batch": micro_batch}}
    for attempt in (tree, tree | {"parallel": parallel | {"schedule": "1f1b", "virtual_stages": 1}}):
        try:
            return JobSpec.model_validate(attempt)
        except ValidationError:
            continue
    return None


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]
