"""Placement of rank actors: one placement-group bundle per tensor-parallel group.

A bundle always lies on one node, so a TP group (consecutive ranks, sharing one
bundle) never spans two nodes; bundles are packed so that groups fill a node
before spilling to the next, which keeps the stages of a pipeline close.
"""

from __future__ import annotations

import ray
from ray._raylet import PlacementGroupID
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from lmforge.errors import UserError


def bundle_of(rank: int, group_size: int) -> int:
    return rank // group_size


def reserve(workers: int, group_size: int, cpus: float, gpus: float, timeout_s: float, name: str = "") -> PlacementGroup:
    """One bundle of `group_size` ranks' resources per TP group. `name` lets the
    driver find and remove the groups of a controller that died."""
    bundle = {"CPU": cpus * group_size} | ({"GPU": gpus * group_size} if gpus else {})
    pg = placement_group([dict(bundle) for _ in range(workers // group_size)], strategy="PACK", name=name)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise UserError(
            f"resources: could not place {workers // group_size} groups of {group_size} workers ({bundle} each) "
            f"within {timeout_s:.0f}s; a tensor-parallel group must fit on one node; "
            f"the cluster has {ray.available_resources()} free"
        ) from None
    return pg


def release(pg: PlacementGroup) -> None:
    remove_placement_group(pg)


def owner_prefix(job: str, controller_id: str) -> str:
    """Names of the placement groups one controller reserves start with this."""
    return f"lmforge/{job}/{controller_id}/"


def release_orphans(prefix: str) -> int:
    """Remove the live placement groups named with `prefix`: a dead controller's.
    Ray ties a placement group to the job, not to the actor that made it, so those
    would otherwise hold their capacity until the job ends. Returns how many."""
    removed = 0
    for pg_id, info in placement_group_table().items():
        if info.get("name", "").startswith(prefix) and info.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))
            removed += 1
    return removed
