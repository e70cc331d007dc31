"""`lmforge plan` through the real CLI: the breakdown as JSON, whether it fits, and
one clear error for a bad --cluster string, a device memory of zero or an unknown
model preset."""

import json

import pytest

from lmforge.memory.estimate import worst_rank
from lmforge.spec import load_spec
from conftest import REPO
from test_cli_errors import assert_clean_error, run_cli

SEVEN_B = str(REPO / "jobs" / "pretrain-7b.yaml")


def test_plan_json_matches_the_estimator_and_judges_the_fit(tmp_path):
    fits = run_cli("plan", SEVEN_B, "--json", "--cluster", "nodes=4,gpus_per_node=8,gpu_mem=80GB", cwd=tmp_path)
    assert fits.returncode == 0, fits.stderr
    report = json.loads(fits.stdout)
    assert report["world_size"] == 32 and report["cluster"]["fits"] is True
    assert report["worst_rank"] == worst_rank(load_spec(SEVEN_B)).as_dict()
    tight = run_cli("plan", SEVEN_B, "--json", "--cluster", "nodes=4,gpus_per_node=8,gpu_mem=2GiB", cwd=tmp_path)
    assert json.loads(tight.stdout)["cluster"]["fits"] is False


def test_plan_prints_a_table(tmp_path):
    result = run_cli("plan", SEVEN_B, "--cluster", "nodes=4,gpus_per_node=8,gpu_mem=80GB", cwd=tmp_path)
    assert result.returncode == 0 and "optimizer states" in result.stdout and "fits in" in result.stdout


@pytest.mark.parametrize("cluster,fragment", [
    ("nodes=4,gpus=8", "--cluster: cannot read 'gpus=8'"),
    ("nodes=4,gpus_per_node=8", "--cluster: gpu_mem missing"),
    ("nodes=4,gpus_per_node=8,gpu_mem=0GB", "--cluster: gpu_mem must be above 0"),
    ("nodes=4,gpus_per_node=8,gpu_mem=lots", "--cluster: gpu_mem 'lots' is not a size"),
])
def test_bad_cluster_strings(tmp_path, cluster, fragment):
    assert_clean_error(run_cli("plan", SEVEN_B, "--cluster", cluster, cwd=tmp_path), fragment)


def test_unknown_preset(tmp_path):
    assert_clean_error(run_cli("plan", SEVEN_B, "--set", "model.preset=99b", cwd=tmp_path), "model.preset", "unknown preset '99b'")
