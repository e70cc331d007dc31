"""Capacity for the job's ranks, held in slots: one single-bundle placement group
per tensor-parallel group. A bundle lies on one node, so a TP group never spans two.

Separate slots let a restart keep the capacity that survived a node loss and put
spare slots in the lost ones' place without giving anything back (a request
waiting for capacity could take it), and let a lost slot go at once: Ray keeps
retrying to place a multi-bundle group's lost bundle, and in Ray 2.60 that retry
loop spins the GCS for as long as no capacity is free.
"""

from __future__ import annotations

import threading
import time

import ray
from ray._private.state import available_resources_per_node
from ray._raylet import PlacementGroupID
from ray.util.placement_group import NODE_ID_LABEL_KEY, PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from lmforge.cluster.topology import NodeRoom
from lmforge.errors import UserError

HEARTBEAT_S = 0.5  # how often the controller pings each node of the job
MISSED_S = 2.0  # a node that has not answered for this long is lost
# A pinger's first answer waits for a worker process to start on its node: seconds
# on a loaded node, so silence is counted from its first answer. Until then only a
# pinger that died (its node with it: Ray says so) or this long a wait marks a node lost.
FIRST_ANSWER_S = 30.0


def tp_bundle(tp: int, cpus_per_worker: float, gpus_per_worker: float) -> dict[str, float]:
    """What one slot (a tensor-parallel group's ranks) takes of its node."""
    return {"CPU": cpus_per_worker * tp} | ({"GPU": gpus_per_worker * tp} if gpus_per_worker else {})


class Slots:
    """The slots one controller holds, in rank order: those of the running layout's
    TP groups first, then spares and capacity reserved for growing."""

    def __init__(self, group_size: int, cpus: float, gpus: float, name: str):
        self.group_size, self.name = group_size, name
        self.bundle = tp_bundle(group_size, cpus, gpus)
        self._held: list[PlacementGroup] = []
        self._made = 0  # Ray wants unique names: slot 0, 1, ... of this controller

    def __len__(self) -> int:
        return len(self._held)

    def group(self, index: int) -> PlacementGroup:
        return self._held[index]

    def strategy(self, index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self._held[index], placement_group_bundle_index=0)

    def add(self, count: int, timeout_s: float, avoid: frozenset[str] = frozenset(), on: list[str] | None = None) -> None:
        """Reserve `count` more slots, all or none within `timeout_s` (UserError).
        `avoid`: nodes known lost that Ray may not have declared dead yet, and would
        otherwise place on. `on`: the node of each new slot (the placement rule's);
        without it Ray chooses."""
        anywhere = [{NODE_ID_LABEL_KEY: f"!in({','.join(sorted(avoid))})"}] if avoid else None
        selectors = [[{NODE_ID_LABEL_KEY: node}] for node in on] if on else [anywhere] * count
        new = [
            placement_group([dict(self.bundle)], name=f"{self.name}{self._made + i}", bundle_label_selector=selector)
            for i, selector in enumerate(selectors)
        ]
        self._made += count
        try:
            ray.get([pg.ready() for pg in new], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            for pg in new:
                remove_placement_group(pg)
            raise UserError(
                f"resources: could not place {count} more groups of {self.group_size} workers ({self.bundle} each) "
                f"within {timeout_s:.0f}s; a tensor-parallel group must fit on one node; "
                f"the cluster has {ray.available_resources()} free"
            ) from None
        self._held += new

    def nodes(self) -> list[str]:
        """The node of each slot ("" while Ray has it nowhere)."""
        table = placement_group_table()  # one call for all
        return [table.get(pg.id.hex(), {}).get("bundles_to_node_id", {}).get(0, "") for pg in self._held]

    def reorder(self, order: list[int]) -> None:
        """Hold the slots in this order of their current indices (those left out go)."""
        for index in set(range(len(self._held))) - set(order):
            remove_placement_group(self._held[index])
        self._held = [self._held[index] for index in order]

    def drop_lost(self, lost: set[str]) -> int:
        """Release the slots on lost nodes (keeping the others' order); how many."""
        kept = []
        for pg, node in zip(self._held, self.nodes()):
            if node and node not in lost:
                kept.append(pg)
            else:
                remove_placement_group(pg)
        dropped, self._held = len(self._held) - len(kept), kept
        return dropped

    def keep(self, count: int) -> None:
        """Release the slots past the first `count`."""
        for pg in self._held[count:]:
            remove_placement_group(pg)
        self._held = self._held[:count]


def node_rooms(bundle: dict, label: str | None, avoid: frozenset[str] = frozenset(), free: bool = True) -> list[NodeRoom]:
    """How many slots of `bundle` each live node holds: in what is free now, or
    (`free=False`) in all it has. With a replica `label`, only the nodes that carry it."""
    resources = available_resources_per_node() if free else {}
    rooms = []
    for node in ray.nodes():
        labels, node_id = node.get("Labels") or {}, node["NodeID"]
        if not node["Alive"] or node_id in avoid or (label and label not in labels):
            continue
        has = resources.get(node_id, {}) if free else node["Resources"]
        room = min(int(has.get(kind, 0.0) // amount) for kind, amount in bundle.items() if amount)
        rooms.append(NodeRoom(node_id, room, labels.get(label, "") if label else ""))
    return rooms


def node_labels(label: str | None) -> dict[str, str]:
    """Each live node's value of `label` ({} without one)."""
    if not label:
        return {}
    return {node["NodeID"]: (node.get("Labels") or {}).get(label, "") for node in ray.nodes() if node["Alive"]}


@ray.remote(num_cpus=0)
class _Pinger:
    def ping(self) -> bool:
        return True


class NodeWatch:
    """Which of the job's nodes still answer. A node that vanished abruptly is
    declared dead only after Ray's health checks time out (tens of seconds), and
    until then Ray keeps placing work on it: ask the nodes. Each node of the job gets
    an idle zero-CPU actor ahead of time, because a fresh task would first wait for
    a worker process to start there, which takes seconds on a loaded node (seen: a
    live node judged lost, and a restart that found no room without it). A thread
    pings them every `HEARTBEAT_S`, so after a failure a node is judged by the beats
    it missed, not by a probe started then. The watch's own node (`home`, by default
    the node it runs on) answers by itself: code that asks is running there."""

    def __init__(self, home: str | None = None):
        self.home = ray.get_runtime_context().get_node_id() if home is None else home
        self._pingers: dict[str, ray.actor.ActorHandle] = {}
        self._watched: dict[str, float] = {}  # node -> when it began to be watched
        self._answered: dict[str, float] = {}  # node -> when it last answered
        self._started: dict[str, float] = {}  # node -> when its pinger's first answer arrived
        self._failed: set[str] = set()  # nodes whose pinger died
        self._stopped = threading.Event()
        self._beating: threading.Thread | None = None

    def watch(self, nodes) -> None:
        """Start a pinger on each node not yet watched, and the heartbeat (returns at once)."""
        for node in set(nodes) - set(self._pingers) - {"", self.home}:
            self._watched[node] = time.time()
            self._failed.discard(node)
            self._answered.pop(node, None)  # a new pinger: its first answer is awaited afresh
            self._started.pop(node, None)
            self._pingers[node] = _Pinger.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        if self._beating is None and self._pingers:
            self._beating = threading.Thread(target=self._beat, name="node-heartbeat", daemon=True)
            self._beating.start()

    def unresponsive(self, nodes: set[str], since: float, missed_s: float = MISSED_S, first_answer_s: float = FIRST_ANSWER_S) -> set[str]:
        """The nodes among `nodes` that have not answered for `missed_s` (or, never
        answered yet, within `first_answer_s` of being watched); waits until each of
        the others has answered after `since` (a failure's time)."""
        nodes = set(nodes) - {"", self.home}
        self.watch(nodes)
        while True:
            now = time.time()
            lost = {node for node in nodes if node in self._failed or self._silent_too_long(node, now, missed_s, first_answer_s)}
            alive = {node for node in nodes - lost if self._answered.get(node, 0.0) > since}
            if lost | alive == nodes:
                for node in lost:
                    self._pingers.pop(node, None)  # it goes with its node
                return lost
            time.sleep(0.05)

    def stop(self) -> None:
        self._stopped.set()

    def _silent_too_long(self, node: str, now: float, missed_s: float, first_answer_s: float) -> bool:
        """Silence counts from the node's last answer, or from its pinger's first (the
        first ping, sent before the process was up, answers only once it is); a pinger
        that never answered has `first_answer_s` from when it was asked for."""
        if node not in self._answered:
            return now - self._watched[node] > first_answer_s
        return now - max(self._answered[node], self._started[node]) > missed_s

    def _beat(self) -> None:
        """An answer counts from when its ping was sent, not when it was collected: the
        collecting can come up to a beat later, after a failure, and a node that answered
        just before it died must not pass for alive after it (seen: the restart placed
        on the lost node, and failed again)."""
        pending: dict[ray.ObjectRef, tuple[str, float]] = {}
        while not self._stopped.is_set():
            began = time.time()
            waiting = {node for node, _ in pending.values()}
            for node, pinger in list(self._pingers.items()):
                if node not in waiting:
                    pending[pinger.ping.remote()] = (node, time.time())
            if pending:
                done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=HEARTBEAT_S)
                for ref in done:
                    node, sent = pending.pop(ref)
                    if _succeeded(ref):
                        self._started.setdefault(node, time.time())
                        self._answered[node] = max(self._answered.get(node, 0.0), sent)
                    else:
                        self._failed.add(node)
            self._stopped.wait(max(0.0, HEARTBEAT_S - (time.time() - began)))


def _succeeded(ref: ray.ObjectRef) -> bool:
    try:
        return ray.get(ref, timeout=0) is True
    except ray.exceptions.RayError:  # its actor or node died: the node is not answering
        return False


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
