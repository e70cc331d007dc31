"""Placement on a real multi-node Ray cluster (several raylets on this machine):
a tensor-parallel group never spans two nodes, and the driver reports the layout."""

import pytest

from conftest import MULTINODE_TIMEOUT_S

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(MULTINODE_TIMEOUT_S)]


def test_tp_groups_stay_on_one_node(multinode):
    summary = multinode[0]["placement"]
    assert summary["final_step"] == 3 and summary["world_size"] == 4
    ranks = summary["ranks"]
    assert [(r["rank"], r["dp"], r["tp"]) for r in ranks] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    group_nodes = {dp: {r["node"] for r in ranks if r["dp"] == dp} for dp in (0, 1)}
    assert all(len(nodes) == 1 for nodes in group_nodes.values()), group_nodes
    assert group_nodes[0] != group_nodes[1], "each 2-CPU node can hold only one TP group"
    assert set().union(*group_nodes.values()) <= set(summary["nodes"])


def test_3d_layout_placed_by_topology(multinode):
    """pp2 x dp2 x tp2 (ranks numbered pp outermost, tp fastest: a replica is ranks
    0,1,4,5 or 2,3,6,7): TP groups inside a node, a replica's stages across nodes
    only when it needs more than one, replicas within one rack when asked."""
    topology = multinode[0]["topology"]
    assert [n["ranks"] for n in topology["two_cpu_nodes"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [n["ranks"] for n in topology["four_cpu_nodes"]] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    by_rack = {tuple(n["ranks"]): n["rack"] for n in topology["by_rack"]}
    assert sorted(by_rack) == [(0, 1), (2, 3), (4, 5), (6, 7)] and "" not in by_rack.values()
    assert by_rack[(0, 1)] == by_rack[(4, 5)] != by_rack[(2, 3)] == by_rack[(6, 7)]
    refused = topology["refused"]
    assert refused["exit_code"] == 2 and "Traceback" not in refused["stderr"]
    assert "resources.replica_label: pp 3 x dp 1 x tp 2 cannot be placed" in refused["stderr"]
    assert "replica 0 of 1 needs 3 tensor-parallel groups within one value of the replica label" in refused["stderr"]
    assert topology["too_wide"] == "parallel.tp: a tensor-parallel group of 2 ranks needs 6 CPU on one node; no node has that much"
