"""Spare ranks: idle, started worker actors on capacity of their own, so that after
a loss the job restarts at the same size instead of shrinking.

Each spare group is tensor-parallel-sized (one placement-group bundle, so on one
node). After a failure the pool is released first, which frees its capacity for
the restarted group; it is then refilled from whatever capacity is left, and again
whenever more appears.
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from lmforge.cluster import placement
from lmforge.cluster.runtime import DATA_CPUS, WORKER_ENV
from lmforge.cluster.worker import Worker
from lmforge.errors import UserError


class SparePool:
    def __init__(self, wanted: int, group_size: int, cpus: float, gpus: float, name: str):
        self.wanted, self.group_size, self.cpus, self.gpus, self.name = wanted, group_size, cpus, gpus, name
        self._groups: list[tuple] = []  # (placement group, idle actors)

    @property
    def ready(self) -> int:
        return len(self._groups) * self.group_size

    def fill(self, timeout_s: float) -> int:
        """Add spare groups until `wanted` ranks are ready or no more fit within
        `timeout_s` each; returns how many ranks are ready."""
        while self.ready < self.wanted:
            if ray.available_resources().get("CPU", 0) - DATA_CPUS < self.group_size * self.cpus:
                break  # clearly no room: skip the placement attempt's wait
            try:
                pg = placement.reserve(self.group_size, self.group_size, self.cpus, self.gpus, timeout_s, self.name)
            except UserError:
                break
            strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)
            actors = [
                Worker.options(num_cpus=self.cpus, num_gpus=self.gpus, scheduling_strategy=strategy, runtime_env={"env_vars": WORKER_ENV}).remote(-1, 0)
                for _ in range(self.group_size)
            ]
            self._groups.append((pg, actors))
        return self.ready

    def release(self) -> None:
        """Give the capacity back (to the restarted group, first of all)."""
        for pg, actors in self._groups:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            placement.release(pg)
        self._groups = []
