"""Placement of rank actors: one bundle per rank in a placement group.

Bundles are packed so that ranks fill a node before spilling to the next; with
tensor parallelism this keeps a TP group (consecutive ranks) on one node.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from lmforge.errors import UserError


def reserve(workers: int, cpus: float, gpus: float, timeout_s: float) -> PlacementGroup:
    bundle = {"CPU": cpus} | ({"GPU": gpus} if gpus else {})
    pg = placement_group([dict(bundle) for _ in range(workers)], strategy="PACK", name="")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise UserError(
            f"resources: could not place {workers} workers of {bundle} within {timeout_s:.0f}s; "
            f"the cluster has {ray.available_resources()} free"
        ) from None
    return pg


def release(pg: PlacementGroup) -> None:
    remove_placement_group(pg)
