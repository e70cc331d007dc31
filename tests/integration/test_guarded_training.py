"""The guards on a real 2-rank Ray job, with faults injected through the job's
`debug` section: NaN losses (a skipped update; K in a row roll back and skip those
batches), a loss spike (rolled back when asked), out-of-memory (retried with a smaller micro-batch down to a floor, with a
memory report in the run directory and MLflow), and a leaked tensor per step."""

import json
import math

import pytest
from mlflow.tracking import MlflowClient

from conftest import tiny_job
from lmforge import sdk
from lmforge.errors import TrainingFailed
from lmforge.spec import spec_from_dict

pytestmark = pytest.mark.ray


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir):
    return {row["step"]: row["loss"] for row in rows(run_dir) if "event" not in row}


def events(run_dir, kind):
    return [row for row in rows(run_dir) if row.get("event") == kind]


def train(tmp_path, tiny_dataset, train=None, **sections):
    job = tiny_job(tmp_path, tiny_dataset, train={"max_steps": 10} | (train or {}), optim={"decay_steps": 10}, **sections)
    return sdk.train(spec_from_dict(job), show_progress=False), tmp_path / "runs" / "tiny"


@pytest.fixture(scope="module")
def one_nan_and_a_leak(ray_session, tiny_dataset, tmp_path_factory):
    """One run for two guards that do not meet: a NaN loss at step 5, and a tensor
    leaked every step under the leak check."""
    return train(tmp_path_factory.mktemp("nan-leak"), tiny_dataset, guards={"leak_check": True}, debug={"nan_at_steps": [5], "leak_per_step": True})


def test_one_nan_step_skips_its_update_and_training_goes_on(one_nan_and_a_leak):
    summary, run_dir = one_nan_and_a_leak
    [nonfinite] = events(run_dir, "nonfinite")
    assert nonfinite["step"] == 5 and nonfinite["loss"] == "nan" and nonfinite["update_skipped"] and nonfinite["in_a_row"] == 1
    got = losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4, 6, 7, 8, 9, 10] and all(math.isfinite(v) for v in got.values())
    assert summary.final_step == 10 and not events(run_dir, "rollback")


@pytest.fixture(scope="module")
def skipped_by_hand(ray_session, tiny_dataset, tmp_path_factory):
    """Steps 5-7's batches skipped from the start: what a rollback must end up equal to."""
    tmp = tmp_path_factory.mktemp("skip")
    _, run_dir = train(tmp, tiny_dataset, guards={"skip_batches": [5, 6, 7], "leak_check": True})
    return run_dir


def test_nan_steps_in_a_row_roll_back_and_skip_their_batches(skipped_by_hand, tiny_dataset, tmp_path):
    summary, run_dir = train(tmp_path, tiny_dataset, debug={"nan_at_steps": [5, 6, 7]})
    assert sorted(e["step"] for e in events(run_dir, "nonfinite")) == [5, 6]  # the third raises the rollback
    [rollback] = events(run_dir, "rollback")
    assert rollback["steps"] == [5, 6, 7] and rollback["skip_batches"] == [5, 6, 7]
    assert sorted(e["step"] for e in events(run_dir, "batch_skipped")) == [5, 6, 7]  # the controller takes reports concurrently
    assert [e["step"] for e in events(run_dir, "restored")] == [4]  # the checkpoint before the trouble
    assert json.loads((run_dir / "skip_batches.json").read_text()) == [5, 6, 7]
    assert summary.final_step == 10 and summary.failures == 0
    # The rolled-back run trained exactly what skipping those batches from the start trains.
    assert losses(run_dir) == pytest.approx(losses(skipped_by_hand), rel=1e-6, abs=0)
    assert sorted(losses(run_dir)) == [1, 2, 3, 4, 8, 9, 10]


def test_leak_check_is_quiet_without_a_leak(skipped_by_hand):
    assert not events(skipped_by_hand, "leak")


def test_leak_check_reports_a_tensor_kept_every_step(one_nan_and_a_leak):
    _, run_dir = one_nan_and_a_leak
    leaks = events(run_dir, "leak")
    assert leaks and leaks[0]["kind"] == "float32 [256] on cpu" and leaks[0]["per_step"] == 1.0
    assert leaks[0]["bytes_per_step"] == 256 * 4


def test_out_of_memory_retries_with_half_the_micro_batch_then_a_spike_rolls_back(ray_session, tiny_dataset, tmp_path):
    """Micro-batch 4 (one per rank and step) "does not fit" at step 6; 2 does not
    either; 1 does. Later, under `on_spike: rollback`, step 11's loss spikes: the run
    restarts from step 8's checkpoint and skips that batch."""
    summary, run_dir = train(
        tmp_path,
        tiny_dataset,
        train={"micro_batch": 4, "max_steps": 12},
        guards={"on_spike": "rollback"},
        debug={"oom_at_step": 6, "oom_above_micro_batch": 1, "spike_at_steps": [11]},
    )
    ooms = events(run_dir, "out_of_memory")
    assert [(e["micro_batch"], e["retry_micro_batch"]) for e in ooms] == [(4, 2), (2, 1)]
    # The rank that ran out of memory lets go of its groups, so its peer, blocked in a
    # collective with it, fails at once and both processes are kept: seen at the second
    # retry, when no checkpoint is being written (at the first, step 4's may still be).
    assert [e["reused"] for e in events(run_dir, "layout")][2:] == [2, 2]
    report = (run_dir / "memory-oom-step6-rank0.txt").read_text()
    assert "micro-batch 2 x 2 accumulation" in report and "activations" in report and "injected by debug.oom_at_step" in report
    assert summary.final_step == 12 and summary.failures == 0
    [rollback] = events(run_dir, "rollback")
    assert rollback["steps"] == [11] and rollback["skip_batches"] == [11] and rollback["cause"].startswith("loss spike at step 11:")
    assert [e["step"] for e in events(run_dir, "restored")][-1] == 8 and [e["step"] for e in events(run_dir, "batch_skipped")] == [11]
    assert sorted(losses(run_dir)) == [*range(1, 11), 12] and losses(run_dir)[12] < 2 * losses(run_dir)[10]
    assert all(row["samples_consumed"] == row["step"] * 8 for row in rows(run_dir) if "event" not in row)  # same global batch
    client = MlflowClient(summary.mlflow_tracking_uri)
    assert "memory-oom-step6-rank0.txt" in {a.path for a in client.list_artifacts(summary.mlflow_run_id)}


def test_out_of_memory_at_the_floor_fails_with_the_report(ray_session, tiny_dataset, tmp_path):
    # Already at the floor: no retry (the retries down to it are the test above).
    with pytest.raises(
        TrainingFailed, match="no smaller micro-batch is left .guards.oom_min_micro_batch 2.; the memory report is memory-oom-step3-rank0.txt"
    ):
        train(
            tmp_path, tiny_dataset, train={"micro_batch": 2}, guards={"oom_min_micro_batch": 2}, debug={"oom_at_step": 3, "oom_above_micro_batch": 1}
        )
    assert (tmp_path / "runs" / "tiny" / "memory-oom-step3-rank0.txt").exists()
