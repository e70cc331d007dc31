"""Which node each tensor-parallel group goes to: the placement rule, pure (no Ray).

Tensor parallelism stays inside a node (a group is one bundle); a data-parallel
replica's pipeline stages are packed on as few nodes as hold them, so a pipeline
crosses nodes only when a replica is larger than a node; replicas are outermost,
so data parallelism takes the slowest links. The closer the ranks, the less
overlappable their traffic: TP's all-reduces block every layer, PP's sends every
micro-batch, DP's gradient reduction overlaps the backward. A lost node then costs
the replicas on it, not a stage of every replica. With a node label (a rack, a
switch), a replica never spans two of its values, and replicas fill one value's
nodes before the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby


class Unplaceable(Exception):
    """The rule cannot place the layout on these nodes; the message says why."""


@dataclass(frozen=True)
class NodeRoom:
    node: str
    groups: int  # how many tensor-parallel groups' bundles the node holds
    label: str = ""  # its value of the replica label ("" without one)


def group_index(stage: int, replica: int, dp: int) -> int:
    """The mesh's (pp, dp) order: the index of a TP group among the job's slots, as
    its ranks are numbered (MeshShape: pp outermost, tp innermost)."""
    return stage * dp + replica


def assign(pp: int, dp: int, spares: int, rooms: list[NodeRoom], by_label: bool = False) -> list[str]:
    """The node of each slot: the job's TP groups in mesh order (`group_index`), then
    the spares. `by_label`: replicas stay within one label value each."""
    regions = _regions(rooms, by_label)
    needed = pp * dp + spares
    if sum(room.groups for room in rooms) < needed:
        raise Unplaceable(f"the nodes hold {sum(room.groups for room in rooms)} tensor-parallel groups; the layout needs {needed}")
    left = {room.node: room.groups for room in rooms}
    nodes: list[str] = [""] * (pp * dp)
    for replica in range(dp):
        region = next((r for r in regions if sum(left[room.node] for room in r) >= pp), None)
        if region is None:
            label = " within one value of the replica label" if by_label else ""
            raise Unplaceable(f"replica {replica} of {dp} needs {pp} tensor-parallel groups{label}; {_left(regions, left)}")
        for stage, node in enumerate(_pack(pp, region, left)):
            nodes[group_index(stage, replica, dp)] = node
    spare_nodes = [room.node for room in rooms for _ in range(left[room.node])][:spares]
    if len(spare_nodes) < spares:
        raise Unplaceable(f"{spares} spare groups beside the replicas do not fit; {_left(regions, left)}")
    return nodes + spare_nodes


def _regions(rooms: list[NodeRoom], by_label: bool) -> list[list[NodeRoom]]:
    """Nodes in the order replicas fill them: by label value (largest first) when
    replicas keep to one, then the roomiest nodes first (fewer crossings)."""
    if not by_label:
        return [sorted(rooms, key=lambda room: (-room.groups, room.node))]
    by_value = sorted(rooms, key=lambda room: room.label)
    regions = [sorted(group, key=lambda room: (-room.groups, room.node)) for _, group in groupby(by_value, key=lambda room: room.label)]
    return sorted(regions, key=lambda region: (-sum(room.groups for room in region), region[0].label))


def _pack(pp: int, region: list[NodeRoom], left: dict[str, int]) -> list[str]:
    """One replica's stages in one region: on a single node where one has room for
    them all (the first such), else across the nodes with the most room left."""
    whole = next((room.node for room in region if left[room.node] >= pp), None)
    if whole is not None:
        left[whole] -= pp
        return [whole] * pp
    stages: list[str] = []
    for room in sorted(region, key=lambda room: -left[room.node]):
        take = min(left[room.node], pp - len(stages))
        stages += [room.node] * take
        left[room.node] -= take
    return stages


def _left(regions: list[list[NodeRoom]], left: dict[str, int]) -> str:
    free = ", ".join(f"{room.node[:12]}{'=' + room.label if room.label else ''}: {left[room.node]}" for region in regions for room in region)
    return f"room left per node, in tensor-parallel groups: {free or 'no nodes'}"


def arrange(pp: int, dp: int, slot_nodes: list[str], labels: dict[str, str], by_label: bool) -> list[int]:
    """A new order for slots already held (a restart's survivors and replacements):
    the slot indices that put the layout's groups where the rule would, as far as
    the slots' nodes allow (label regions given up if they cannot be kept)."""
    counts: dict[str, int] = {}
    for node in slot_nodes:
        counts[node] = counts.get(node, 0) + 1
    rooms = [NodeRoom(node, count, labels.get(node, "")) for node, count in counts.items()]
    spares = len(slot_nodes) - pp * dp
    try:
        wanted = assign(pp, dp, spares, rooms, by_label)
    except Unplaceable:
        wanted = assign(pp, dp, spares, rooms, False)  # total room suffices: this cannot fail
    free: dict[str, list[int]] = {}
    for index, node in enumerate(slot_nodes):
        free.setdefault(node, []).append(index)
    return [free[node].pop(0) for node in wanted]
