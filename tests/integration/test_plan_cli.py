"""`lmforge plan` through the real CLI: the breakdown as JSON, whether it fits, the
PNG chart, the ranked layouts of `--search` for a 32-GPU cluster, and one clear
error for a bad --cluster string, a device memory of zero or an unknown model preset."""

import json

import pytest

from cli import assert_clean_error, run_cli
from conftest import REPO
from lmforge.memory.estimate import worst_rank
from lmforge.spec import load_spec

SEVEN_B = str(REPO / "jobs" / "pretrain-7b.yaml")


def test_plan_json_matches_the_estimator_and_judges_the_fit(tmp_path):
    fits = run_cli("plan", SEVEN_B, "--json", "--cluster", "nodes=4,gpus_per_node=8,gpu_mem=80GB", cwd=tmp_path)
    assert fits.returncode == 0, fits.stderr
    report = json.loads(fits.stdout)
    assert report["world_size"] == 32 and report["cluster"]["fits"] is True
    assert report["worst_rank"] == worst_rank(load_spec(SEVEN_B)).as_dict()
    tight = run_cli(
        "plan", SEVEN_B, "--json", "--cluster", "nodes=4,gpus_per_node=8,gpu_mem=2GiB", "--set", "checkpoint.in_memory=true", cwd=tmp_path
    )
    tight_report = json.loads(tight.stdout)
    assert tight_report["cluster"]["fits"] is False and "in_memory_host_bytes_per_rank" not in report
    # In-memory checkpoints: the rank's weights and AdamW moments, on two nodes, for two snapshots.
    worst = report["worst_rank"]
    assert tight_report["in_memory_host_bytes_per_rank"] == 4 * (worst["params"] + worst["optimizer"] + worst["host"])


# `lmforge plan JOB --json` run as the program, with a library printing to stdout before
# the JSON (through Python and through the file itself) and once the process exits.
NOISY = """
import atexit, os, sys
import lmforge.cli as cli
atexit.register(lambda: os.write(1, b"native noise at exit\\n"))
print_json = cli.common.print_json
def noisy(value, out):
    print("python noise")
    os.write(1, b"native noise\\n")
    return print_json(value, out)
cli.common.print_json = noisy
sys.argv = ["lmforge", "plan", sys.argv[1], "--json", "--no-chart"]
sys.exit(cli.main())
"""


def test_json_on_stdout_is_the_json_alone(tmp_path):
    """What else prints to stdout while a `--json` command runs (Ray, MLflow, native
    code, exit handlers) goes to stderr: stdout parses whole, as a pipe into `jq` needs."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", NOISY, SEVEN_B], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["world_size"] == 32
    assert done.stderr.splitlines()[-3:] == ["python noise", "native noise", "native noise at exit"]


def test_plan_prints_a_table_and_draws_a_chart(tmp_path):
    result = run_cli(
        "plan",
        SEVEN_B,
        "--cluster",
        "nodes=4,gpus_per_node=8,gpu_mem=80GB",
        "--chart",
        "chart.png",
        "--set",
        "checkpoint.in_memory=true",
        cwd=tmp_path,
    )
    assert result.returncode == 0 and "optimizer states" in result.stdout and "fits:" in result.stdout
    assert "in-memory checkpoints (checkpoint.in_memory):" in result.stdout and "of host memory per rank" in result.stdout
    assert_png(tmp_path / "chart.png")


def test_search_ranks_layouts_for_32_gpus(tmp_path):
    result = run_cli("plan", SEVEN_B, "--search", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["cluster"]["nodes"] * plan["cluster"]["gpus_per_node"] == 32 and "assumed from the job's 32 ranks" in result.stderr
    best = plan["best"]
    assert len(best) == 5 and plan["layouts_that_fit"] >= 5
    assert [b["step_seconds"] for b in best] == sorted(b["step_seconds"] for b in best)
    for layout in best:
        assert layout["tp"] * layout["pp"] * layout["dp"] == 32 and 8 % layout["tp"] == 0
        assert layout["peak_bytes"] <= plan["cluster"]["usable"]
    # The job's own layout (tp 8 within a node, pp 2) fits but is slower than the best.
    assert plan["job_layout"]["fits"] and plan["job_layout"]["rank"] > 1 and plan["job_layout"]["slower_than_best"] > 0
    assert_png(tmp_path / "runs" / "pretrain-7b" / "memory-search.png")
    text = run_cli("plan", SEVEN_B, "--search", "--top", "3", "--no-chart", "--cluster", "nodes=4,gpus_per_node=8,gpu_mem=80GB", cwd=tmp_path)
    assert text.returncode == 0 and "best 3 of" in text.stdout and "best: tp" in text.stdout and "the job's own layout" in text.stdout


def test_search_where_only_cpu_offload_fits_and_where_nothing_does(tmp_path):
    result = run_cli("plan", SEVEN_B, "--search", "--no-chart", "--cluster", "nodes=1,gpus_per_node=2,gpu_mem=8GB", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "no layout fits 8 GB devices as it is; with CPU offload" in result.stdout
    assert "--set parallel.cpu_offload=true" in result.stdout and "GiB of host memory per rank" in result.stdout
    result = run_cli("plan", SEVEN_B, "--search", "--cluster", "nodes=1,gpus_per_node=2,gpu_mem=8GB,host_mem=64GB", cwd=tmp_path)
    assert_clean_error(result, "--cluster: no layout of pretrain-7b fits", "CPU offload included", "NVMe offload")


def test_plan_of_a_serving_replica(tmp_path):
    """The 7B's weights and KV cache (bf16, 32 sequences of 4,096 positions), and how many
    full-context sequences an 80 GB device holds beside the weights."""
    from lmforge.memory.serving import serving_memory
    from lmforge.spec import load_spec

    args = ["--serve", "--dtype", "bf16", "--sequences", "32", "--context", "4096", "--cluster", "nodes=1,gpus_per_node=8,gpu_mem=80GB"]
    plan = json.loads(run_cli("plan", SEVEN_B, *args, "--json", cwd=tmp_path).stdout)
    want = serving_memory(load_spec(SEVEN_B).model_arch, "bf16", 32, 4096)
    assert (plan["weights"], plan["kv_per_sequence"], plan["total"]) == (want.weights, want.kv_per_sequence, want.total)
    assert plan["sequences_per_device"] == want.sequences_that_fit(80 * 10**9) > 0
    text = run_cli("plan", SEVEN_B, *args, cwd=tmp_path)
    assert (
        text.returncode == 0
        and "KV cache, 32 sequences" in text.stdout
        and f"holds the weights and {plan['sequences_per_device']} full-context" in text.stdout
    )
    assert_clean_error(run_cli("plan", SEVEN_B, "--serve", "--dtype", "int3", cwd=tmp_path), "--dtype: 'int3' is not one of fp32, bf16, fp16")


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.parametrize(
    "cluster,fragment",
    [
        ("nodes=4,gpus=8", "--cluster: cannot read 'gpus=8'"),
        ("nodes=4,gpus_per_node=8", "--cluster: gpu_mem missing"),
        ("nodes=4,gpus_per_node=8,gpu_mem=0GB", "--cluster: gpu_mem must be above 0"),
        ("nodes=4,gpus_per_node=8,gpu_mem=lots", "--cluster: gpu_mem 'lots' is not a size"),
    ],
)
def test_bad_cluster_strings(tmp_path, cluster, fragment):
    assert_clean_error(run_cli("plan", SEVEN_B, "--cluster", cluster, cwd=tmp_path), fragment)


def test_unknown_preset(tmp_path):
    assert_clean_error(run_cli("plan", SEVEN_B, "--set", "model.preset=99b", cwd=tmp_path), "model.preset", "unknown preset '99b'")


def test_plan_counts_a_lora_jobs_trainable_parameters(tmp_path):
    """`model.lora`: the plan says how many parameters train, the adapters' r * (in + out)
    for each of a block's seven linear layers, and the optimizer holds their states alone."""
    lora = ["--set", "model.lora={rank: 8}"]
    result = run_cli("plan", SEVEN_B, "--json", *lora, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    cfg = load_spec(SEVEN_B).model_arch
    attention = 2 * (cfg.dim + cfg.n_heads * cfg.head_dim) + 2 * (cfg.dim + cfg.n_kv_heads * cfg.head_dim)
    per_block = 8 * (attention + 3 * (cfg.dim + cfg.ffn_hidden))
    assert report["lora"] == {"rank": 8, "trainable_parameters": cfg.n_layers * per_block, "model_parameters": cfg.num_params()}
    full = json.loads(run_cli("plan", SEVEN_B, "--json", cwd=tmp_path).stdout)
    assert report["worst_rank"]["optimizer"] < full["worst_rank"]["optimizer"] / 50  # 0.3% of the parameters train
    shown = " ".join(run_cli("plan", SEVEN_B, "--no-chart", *lora, cwd=tmp_path).stdout.split())  # as wrapped to the terminal
    assert f"LoRA (model.lora, rank 8): {cfg.n_layers * per_block:,} trainable parameters of the model's {cfg.num_params():,}" in shown
