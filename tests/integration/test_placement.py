"""Placement on a real multi-node Ray cluster (several raylets on this machine):
a tensor-parallel group never spans two nodes, and the driver reports the layout."""

from pathlib import Path

import pytest

from conftest import tiny_job
from multinode import run_script

pytestmark = [pytest.mark.ray, pytest.mark.slow]
SCRIPT = Path(__file__).with_name("multinode_run.py")


def test_tp_groups_stay_on_one_node(tiny_dataset, tmp_path):
    job = tiny_job(tmp_path, tiny_dataset, parallel={"dp": 2, "tp": 2}, train={"max_steps": 3}, checkpoint={"interval": 3})
    summary = run_script(SCRIPT, job, tmp_path, timeout_s=400)
    assert summary["final_step"] == 3 and summary["world_size"] == 4
    ranks = summary["ranks"]
    assert [(r["rank"], r["dp"], r["tp"]) for r in ranks] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    group_nodes = {dp: {r["node"] for r in ranks if r["dp"] == dp} for dp in (0, 1)}
    assert all(len(nodes) == 1 for nodes in group_nodes.values()), group_nodes
    assert group_nodes[0] != group_nodes[1], "each 2-CPU node can hold only one TP group"
    assert set().union(*group_nodes.values()) <= set(summary["nodes"])
