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
