"""Where in-memory checkpoints live (`checkpoint.in_memory`): one `Keeper` actor per
node holds the snapshot files of that node's ranks and a replica of another node's,
so losing one node never loses both copies.

The controller keeps the keepers across attempts while their nodes live (`Keepers`),
records the newest snapshot every rank finished, and at a restart tells the ranks
where each of its files is (`SnapshotSource`), when the live keepers still hold all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

KEEPER_ANSWER_S = 5.0  # a keeper that does not list its snapshots in this long counts as gone


@ray.remote(num_cpus=0)
class Keeper:
    def __init__(self):
        self.steps: dict[int, dict[int, dict[str, bytes]]] = {}  # step -> rank -> name -> bytes

    def put(self, step: int, rank: int, files: dict[str, bytes]) -> None:
        # A rank starts a snapshot only once every rank finished the one before, so
        # the last two begun are the last complete one and the one being taken (by
        # order begun, not by step: a restart from storage may go back).
        if step not in self.steps:
            for old in list(self.steps)[:-1]:
                del self.steps[old]
        self.steps.setdefault(step, {})[rank] = files

    def holds(self, step: int) -> dict[int, list[str]]:
        return {rank: list(files) for rank, files in self.steps.get(step, {}).items()}

    def file(self, step: int, name: str) -> bytes:
        for files in self.steps.get(step, {}).values():
            if name in files:
                return files[name]
        raise KeyError(name)

    def clear(self) -> None:
        self.steps = {}


@dataclass
class SnapshotSource:
    """A complete snapshot to restore from: each file's keepers."""

    step: int
    holders: dict[str, list]

    def fetch(self, name: str) -> bytes:
        """The file's bytes from the first keeper that answers; KeyError when none holds it."""
        for keeper in self.holders.get(name, []):
            try:
                return ray.get(keeper.file.remote(self.step, name))
            except ray.exceptions.RayError:
                continue  # its node went since: the replica
        raise KeyError(name)


class SnapshotShipper:
    """A rank's `SnapshotTarget`: its files go to its node's keeper and the replica's."""

    def __init__(self, keepers: list, controller, attempt: int):
        self.keepers, self.controller, self.attempt = keepers, controller, attempt

    def put(self, step: int, rank: int, files: dict[str, bytes]) -> None:
        ref = ray.put(files)  # serialized once for both keepers
        ray.get([keeper.put.remote(step, rank, ref) for keeper in self.keepers])

    def taken(self, step: int, world: int) -> None:
        ray.get(self.controller.snapshot_taken.remote(step, world, self.attempt))


class Keepers:
    """The controller's side: a keeper per node of the layout, the newest complete snapshot."""

    def __init__(self):
        self.by_node: dict[str, object] = {}
        self.latest: Optional[tuple[int, int]] = None  # (step, world) every rank finished

    def place(self, rank_nodes: list[str], alive: set[str]) -> list[list]:
        """Keepers on the layout's nodes (those of lost nodes dropped); for each rank,
        its node's keeper and the next node's, where there is another node."""
        self.by_node = {node: keeper for node, keeper in self.by_node.items() if node in alive}
        nodes = sorted(set(rank_nodes))
        for node in nodes:
            if node not in self.by_node:
                self.by_node[node] = Keeper.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        replica = {node: nodes[(i + 1) % len(nodes)] for i, node in enumerate(nodes)}
        return [[self.by_node[n] for n in dict.fromkeys([node, replica[node]])] for node in rank_nodes]

    def source(self) -> Optional[SnapshotSource]:
        """The newest complete snapshot if the live keepers still hold every rank's files."""
        if self.latest is None:
            return None
        step, world = self.latest
        asked = {keeper.holds.remote(step): keeper for keeper in self.by_node.values()}
        answered, _ = ray.wait(list(asked), num_returns=len(asked), timeout=KEEPER_ANSWER_S)
        holders: dict[str, list] = {}
        ranks: set[int] = set()
        for ref in answered:
            try:
                held = ray.get(ref)
            except ray.exceptions.RayError:
                continue  # gone with its node
            for rank, names in held.items():
                ranks.add(rank)
                for name in names:
                    holders.setdefault(name, []).append(asked[ref])
        return SnapshotSource(step, holders) if ranks >= set(range(world)) else None

    def taken(self, step: int, world: int) -> None:
        self.latest = (step, world)

    def forget(self) -> None:
        """No snapshot held is a place to return to (a rollback's, or an incomplete one)."""
        self.latest = None
        cleared = [keeper.clear.remote() for keeper in self.by_node.values()]
        if cleared:  # before a rank's next snapshot arrives
            ray.wait(cleared, num_returns=len(cleared), timeout=KEEPER_ANSWER_S)

    def stop(self) -> None:
        for keeper in self.by_node.values():
            ray.kill(keeper, no_restart=True)
        self.by_node = {}
