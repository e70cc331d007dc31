"""The Controller actor: reserves the placement group, starts one Worker per rank,
hands out the rendezvous, runs the group and relays rank 0's events to the driver.

A failing rank tears the whole group down so no survivor stays blocked in a
collective. Restart-on-failure and elasticity build on this object.
"""

from __future__ import annotations

import threading
import time

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from lmforge.cluster import placement
from lmforge.cluster.runtime import WORKER_ENV
from lmforge.cluster.worker import Worker
from lmforge.parallel.mesh import MeshShape
from lmforge.spec import JobSpec


@ray.remote(num_cpus=0, max_concurrency=8)
class Controller:
    def __init__(self, spec_dict: dict, manifest: dict, placement_timeout_s: float = 120.0):
        self.spec_dict, self.manifest = spec_dict, manifest
        self.placement_timeout_s = placement_timeout_s
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._workers: list = []
        self._pg = None

    def report(self, event: dict) -> None:
        with self._lock:
            self._events.append(event | {"time": time.time()})

    def drain(self) -> list[dict]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def run(self) -> dict:
        controller_handle = ray.get_runtime_context().current_actor
        spec = JobSpec.model_validate(self.spec_dict)
        world = spec.world_size
        cpus, gpus = spec.resources.cpus_per_worker, spec.resources.gpus_per_worker
        tp = spec.parallel.tp
        self._pg = placement.reserve(world, tp, cpus, gpus, self.placement_timeout_s)
        try:
            self._start_workers(world, tp, cpus, gpus)
            p = spec.parallel
            layout = self._rendezvous(MeshShape.for_spec(p))
            self.report({"event": "layout", "ranks": layout})
            results = _wait_all([w.train.remote(self.spec_dict, self.manifest, controller_handle) for w in self._workers])
            try:
                ray.get([w.shutdown.remote() for w in self._workers], timeout=60)
            except ray.exceptions.RayError:
                pass  # training finished and was reported; the actors are killed next anyway
            return results[0] | {"world_size": world}
        finally:
            self._teardown()

    def _start_workers(self, world: int, tp: int, cpus: float, gpus: float) -> None:
        for rank in range(world):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=placement.bundle_of(rank, tp))
            self._workers.append(
                Worker.options(
                    num_cpus=cpus, num_gpus=gpus, scheduling_strategy=strategy,
                    runtime_env={"env_vars": WORKER_ENV}, name=None,
                ).remote(rank, world)
            )

    def _rendezvous(self, shape: MeshShape) -> list[dict]:
        addresses = ray.get([w.address.remote() for w in self._workers])
        master_addr, master_port, _ = addresses[0]
        ray.get([w.setup.remote(master_addr, master_port) for w in self._workers])
        return [{"rank": r, **shape.coordinates(r), "ip": ip, "node": node[:12]} for r, (ip, _, node) in enumerate(addresses)]

    def _teardown(self) -> None:
        for worker in self._workers:
            ray.kill(worker, no_restart=True)
        self._workers = []
        if self._pg is not None:
            placement.release(self._pg)
            self._pg = None


def _wait_all(refs: list) -> list:
    """Like ray.get, but raises as soon as any rank fails instead of waiting on the
    survivors, which would block forever in their next collective."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done[0])
    return ray.get(refs)
