"""The placement rule (cluster.topology): TP inside a node, a replica's stages on as
few nodes as hold them, replicas outermost (and within one label value when asked)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmforge.cluster.topology import NodeRoom, Unplaceable, arrange, assign, group_index
from lmforge.parallel.shape import MeshShape


def _ranks_by_node(pp, dp, tp, nodes):
    """node -> the global ranks placed on it, with the mesh's rank numbering."""
    shape, placed = MeshShape.for_layout(pp, dp, tp, zero=0), {}
    for rank in range(pp * dp * tp):
        c = shape.coordinates(rank)
        placed.setdefault(nodes[group_index(c["pp"], c["dp"], dp)], []).append(rank)
    return placed


def test_pp2_dp2_tp2_on_four_nodes_of_two():
    nodes = assign(2, 2, 0, [NodeRoom(n, 1) for n in "abcd"])
    # ranks: pp outermost, tp fastest: 0-1 (pp0 dp0), 2-3 (pp0 dp1), 4-5 (pp1 dp0), 6-7 (pp1 dp1)
    assert sorted(_ranks_by_node(2, 2, 2, nodes).values()) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert nodes[group_index(0, 0, 2)] != nodes[group_index(1, 0, 2)], "a replica's stages cross nodes"


def test_pp2_dp2_tp2_on_two_nodes_of_four():
    nodes = assign(2, 2, 0, [NodeRoom("a", 2), NodeRoom("b", 2)])
    # a whole replica (both stages) per node: DP crosses the nodes, the pipeline does not
    assert sorted(_ranks_by_node(2, 2, 2, nodes).values()) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_replicas_keep_to_one_label_value():
    rooms = [NodeRoom("n1", 1, "rack-a"), NodeRoom("n2", 1, "rack-b"), NodeRoom("n3", 1, "rack-a"), NodeRoom("n4", 1, "rack-b")]
    nodes = assign(2, 2, 0, rooms, by_label=True)
    rack = {room.node: room.label for room in rooms}
    for replica in range(2):
        assert len({rack[nodes[group_index(stage, replica, 2)]] for stage in range(2)}) == 1
    unlabelled = assign(2, 2, 0, rooms)
    assert any(len({rack[unlabelled[group_index(s, r, 2)]] for s in range(2)}) == 2 for r in range(2)), "the test needs the label to matter"


def test_a_replica_that_no_label_value_holds_is_refused():
    rooms = [NodeRoom("n1", 1, "rack-a"), NodeRoom("n2", 1, "rack-b"), NodeRoom("n3", 1, "rack-c"), NodeRoom("n4", 1, "rack-c")]
    with pytest.raises(Unplaceable, match=r"replica 1 of 2 needs 2 tensor-parallel groups within one value of the replica label"):
        assign(2, 2, 0, rooms, by_label=True)
    assert len(assign(2, 2, 0, rooms)) == 4  # the same nodes hold it without the label


def test_too_little_room_names_the_numbers():
    with pytest.raises(Unplaceable, match="the nodes hold 3 tensor-parallel groups; the layout needs 5"):
        assign(2, 2, 1, [NodeRoom("a", 2), NodeRoom("b", 1), NodeRoom("c", 0)])


def test_spares_go_where_room_is_left():
    nodes = assign(1, 2, 1, [NodeRoom("a", 2), NodeRoom("b", 1)])
    assert nodes[:2] == ["a", "a"] and nodes[2] == "b"


def test_arrange_orders_survivors_by_the_rule():
    # after a restart: slots on a, b, a, b (Ray's order); pp2 dp2 wants each replica on one node
    order = arrange(2, 2, ["a", "b", "a", "b"], {}, by_label=False)
    held = ["a", "b", "a", "b"]
    placed = [held[i] for i in order]
    assert sorted(order) == [0, 1, 2, 3]
    assert placed[group_index(0, 0, 2)] == placed[group_index(1, 0, 2)] and placed[group_index(0, 1, 2)] == placed[group_index(1, 1, 2)]


@settings(max_examples=200, deadline=None)
@given(
    pp=st.integers(1, 4),
    dp=st.integers(1, 4),
    spares=st.integers(0, 2),
    rooms=st.lists(st.tuples(st.integers(0, 6), st.sampled_from("xyz")), min_size=1, max_size=6),
    by_label=st.booleans(),
)
def test_assignment_never_overfills_and_keeps_replicas_together(pp, dp, spares, rooms, by_label):
    nodes = [NodeRoom(f"n{i}", groups, label) for i, (groups, label) in enumerate(rooms)]
    try:
        placed = assign(pp, dp, spares, nodes, by_label)
    except Unplaceable:
        assert sum(r.groups for r in nodes) < pp * dp + spares or by_label or max(r.groups for r in nodes) < 1
        return
    assert len(placed) == pp * dp + spares
    for room in nodes:
        assert placed.count(room.node) <= room.groups
    label = {room.node: room.label for room in nodes}
    largest = max(room.groups for room in nodes)
    for replica in range(dp):
        stages = {placed[group_index(s, replica, dp)] for s in range(pp)}
        if by_label:
            assert len({label[node] for node in stages}) == 1
        if pp <= largest and replica == 0:
            assert len(stages) == 1, "the first replica fits on one node: it is packed there"
