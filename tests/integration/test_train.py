"""End to end on a real local Ray cluster: 2 worker actors, gloo, FSDP2, real
Parquet shards, DCP checkpoints, a real MLflow SQLite store."""

import json

import pytest
from mlflow.tracking import MlflowClient

from lmforge import sdk
from lmforge.spec import spec_from_dict

from conftest import tiny_job

pytestmark = pytest.mark.ray


def _step_rows(run_dir):
    """metrics.jsonl's step lines (event lines, such as "restored", have an `event` key)."""
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [row for row in rows if "event" not in row]


def _losses(run_dir):
    return {row["step"]: row["loss"] for row in _step_rows(run_dir)}


@pytest.fixture(scope="module")
def uninterrupted(ray_session, tiny_dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    spec = spec_from_dict(tiny_job(tmp, tiny_dataset))
    summary = sdk.train(spec, show_progress=False)
    return tmp, spec, summary


def test_two_workers_train_and_loss_decreases(uninterrupted):
    tmp, spec, summary = uninterrupted
    losses = _losses(tmp / "runs" / "tiny")
    assert sorted(losses) == list(range(1, 9))
    assert (losses[7] + losses[8]) / 2 < losses[1] - 0.3, losses
    assert summary["final_step"] == 8 and summary["world_size"] == 2
    assert summary["final_loss"] == pytest.approx(losses[8])
    assert 0 <= summary["data_wait_fraction"] < 0.5


def test_run_dir_files_and_checkpoints(uninterrupted):
    tmp, spec, summary = uninterrupted
    on_disk = json.loads((tmp / "runs" / "tiny" / "summary.json").read_text())
    assert on_disk == summary
    assert summary["tokens"] == 8 * 8 * 32
    ckpt = tmp / "runs" / "tiny" / "checkpoints" / "step_00000008"
    assert summary["latest_checkpoint"] == str(ckpt)
    files = json.loads((ckpt / "commit.json").read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "state.json"} <= set(files)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == 8 and state["samples_consumed"] == 64
    row = json.loads((tmp / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time", "data_wait"} <= set(row)
    assert 0 < row["mfu"] < 1


def test_mlflow_run_has_params_metrics_and_spec(uninterrupted):
    tmp, spec, summary = uninterrupted
    client = MlflowClient(tracking_uri=summary["mlflow_tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["train.global_batch"] == "8"
    assert run.data.params["parallel.dp"] == "2"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 9))
    for key in ("lr", "grad_norm", "tokens_per_s", "mfu", "step_time", "data_wait"):
        assert len(client.get_metric_history(run.info.run_id, key)) == 8
    assert "job.yaml" in [a.path for a in client.list_artifacts(run.info.run_id)]


def test_resume_continues_with_identical_losses(uninterrupted, ray_session, tiny_dataset, tmp_path):
    _, _, full = uninterrupted
    reference = _losses(full_run_dir(full))
    job = tiny_job(tmp_path, tiny_dataset)
    first = sdk.train(spec_from_dict(job, ["train.max_steps=4"]), show_progress=False)
    assert first["final_step"] == 4
    second = sdk.train(spec_from_dict(job), show_progress=False)
    assert second["start_step"] == 4 and second["final_step"] == 8
    assert second["mlflow_run_id"] == first["mlflow_run_id"]
    resumed = _losses(tmp_path / "runs" / "tiny")
    assert sorted(resumed) == list(range(1, 9))
    for step in range(1, 9):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), step
    client = MlflowClient(tracking_uri=second["mlflow_tracking_uri"])
    assert sorted(m.step for m in client.get_metric_history(second["mlflow_run_id"], "loss")) == list(range(1, 9))


def full_run_dir(summary):
    from pathlib import Path

    return Path(summary["run_dir"])


def test_a_failing_rank_tears_the_group_down_with_one_message(ray_session, tiny_dataset, tmp_path):
    import shutil

    from lmforge.errors import TrainingFailed

    broken = tmp_path / "broken"
    shutil.copytree(tiny_dataset, broken)
    for shard in broken.glob("shard-*.parquet"):
        shard.write_bytes(b"not parquet")  # readable manifest, unreadable shards
    with pytest.raises(TrainingFailed, match="traceback in") as err:
        sdk.train(spec_from_dict(tiny_job(tmp_path, broken)), show_progress=False)
    assert "\n" not in str(err.value)
    assert (tmp_path / "runs" / "tiny" / "error.txt").read_text()
    assert not (tmp_path / "runs" / "tiny" / "summary.json").exists()


def test_3d_run_through_the_controller_matches_data_parallel(uninterrupted, ray_session, tiny_dataset, tmp_path):
    _, _, full = uninterrupted
    reference = _losses(full_run_dir(full))
    job = tiny_job(
        tmp_path, tiny_dataset,
        parallel={"dp": 2, "tp": 2, "pp": 2}, train={"max_steps": 3},
        checkpoint={"interval": 3}, resources={"cpus_per_worker": 0.5},
    )
    spec = spec_from_dict(job)
    summary = sdk.train(spec, show_progress=False)
    assert summary["world_size"] == 8
    assert {(r["pp"], r["dp"], r["tp"]) for r in summary["ranks"]} == {(p, d, t) for p in (0, 1) for d in (0, 1) for t in (0, 1)}
    losses = _losses(tmp_path / "runs" / "tiny")
    for step in (1, 2, 3):
        assert losses[step] == pytest.approx(reference[step], rel=1e-4), step
    # Each step logs its measured pipeline bubble next to 1F1B's (p-1)/(m+p-1).
    rows = _step_rows(tmp_path / "runs" / "tiny")
    assert all(0 < row["bubble"] < 1 for row in rows)
    assert all(row["bubble_theory"] == pytest.approx(1 / (spec.grad_accum + 1)) for row in rows)


def test_deepspeed_documentation_config_trains_resumes_and_matches_native(uninterrupted, ray_session, tiny_dataset, tmp_path):
    """jobs/zero3-offload.json as written (ZeRO-3, optimizer offloaded to CPU) with the
    batch and learning rate overridden to the tiny job's: 4 steps, then a resume to
    8, equal to the native engine's uninterrupted run."""
    from pathlib import Path

    _, _, full = uninterrupted
    reference = _losses(full_run_dir(full))
    config = Path(__file__).parents[2] / "jobs" / "zero3-offload.json"
    job = tiny_job(tmp_path, tiny_dataset, engine="deepspeed", deepspeed={"config": str(config)})
    del job["optim"]["lr"]  # the config sets it: the job must not say otherwise
    overrides = ["deepspeed.config.train_batch_size=8", "deepspeed.config.optimizer.params.lr=0.003"]
    first = sdk.train(spec_from_dict(job, [*overrides, "train.max_steps=4"]), show_progress=False)
    second = sdk.train(spec_from_dict(job, overrides), show_progress=False)
    assert first["final_step"] == 4 and second["start_step"] == 4 and second["final_step"] == 8
    losses = _losses(tmp_path / "runs" / "tiny")
    for step in range(1, 9):
        assert losses[step] == pytest.approx(reference[step], rel=1e-4), step
    ckpt = tmp_path / "runs" / "tiny" / "checkpoints" / "step_00000008"
    assert json.loads((ckpt / "state.json").read_text())["format"] == "deepspeed"
    files = json.loads((ckpt / "commit.json").read_text())["files"]
    assert any(name.startswith("deepspeed/") and "optim_states" in name for name in files), files
    params = MlflowClient(tracking_uri=second["mlflow_tracking_uri"]).get_run(second["mlflow_run_id"]).data.params
    assert params["engine"] == "deepspeed"
    assert params["deepspeed.config.zero_optimization.stage"] == "3"
    assert params["deepspeed.config.zero_optimization.offload_optimizer.device"] == "cpu"
