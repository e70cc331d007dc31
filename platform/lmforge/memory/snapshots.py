"""Host memory that in-memory checkpoints take (`checkpoint.in_memory`), for
`lmforge plan` and the pre-flight refusal.

A snapshot holds a rank's weights and optimizer state (not its gradients). Its node
keeps one copy and another node a replica, and while the next snapshot is taken the
last complete one is kept too: up to four copies of each rank's state in the cluster's host memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.errors import UserError
from lmforge.memory.estimate import Breakdown, worst_rank

if TYPE_CHECKING:
    from lmforge.spec import JobSpec

COPIES = 4  # (its node + a replica) x (the last complete snapshot + the one being taken)


def snapshot_bytes(breakdown: Breakdown) -> int:
    """One copy of a rank's snapshot: what DCP saves of it (NVMe-resident states too)."""
    return breakdown.params + breakdown.optimizer + breakdown.host + breakdown.disk


def host_bytes_per_rank(spec: JobSpec) -> int:
    return COPIES * snapshot_bytes(worst_rank(spec))


def check_host_memory(spec: JobSpec, nodes: list[dict]) -> None:
    """Refuse `checkpoint.in_memory` where a node that can hold ranks could not hold
    their copies. `nodes`: Ray's node table (`ray.nodes()`); a node's host memory is
    its `memory` resource, what Ray lets its tasks and actors use."""
    res = spec.resources
    per_rank = host_bytes_per_rank(spec)
    ranks = spec.world_size + spec.fault_tolerance.spares
    for node in nodes:
        resources = node.get("Resources", {})
        if not node.get("Alive") or resources.get("CPU", 0) < res.cpus_per_worker or resources.get("GPU", 0) < res.gpus_per_worker:
            continue
        slots = int(resources["CPU"] // res.cpus_per_worker)
        if res.gpus_per_worker:
            slots = min(slots, int(resources["GPU"] // res.gpus_per_worker))
        held = min(ranks, slots)
        memory = resources.get("memory", 0)
        if held * per_rank > memory:
            raise UserError(
                f"checkpoint.in_memory: each rank's snapshot is {_gib(per_rank // COPIES)} (weights and optimizer state), kept "
                f"{COPIES} times over (its node and a replica, the last snapshot and the one being taken): {_gib(per_rank)} per rank; "
                f"node {node['NodeID'][:12]} may hold {held} ranks, {_gib(held * per_rank)}, and has {_gib(memory)} of host memory for "
                "Ray; turn checkpoint.in_memory off, spread the ranks over more nodes, or shard the state further"
            )


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"
