"""A rank's actor process is killed mid-run: the controller tears the group down,
restarts from the latest committed checkpoint, and the run ends as if nothing had
happened (same losses, every sample exactly once in the uninterrupted order)."""

import pytest

from lmforge import sdk
from lmforge.data.order import GlobalOrder
from lmforge.data.prepare import read_manifest
from lmforge.spec import spec_from_dict

from chaos import events, kill_one_rank_process, step_rows, when_step_reached
from conftest import tiny_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]


STEPS = 60  # tiny steps take ~40 ms: enough of them that the kill lands mid-run


def job(tmp_path, tiny_dataset, interval=10):
    return tiny_job(
        tmp_path, tiny_dataset, train={"max_steps": STEPS}, optim={"decay_steps": STEPS}, checkpoint={"interval": interval},
        data={"path": str(tiny_dataset), "prefetch_steps": 4, "record_sample_ids": True},
        fault_tolerance={"max_failures": 2, "backoff_s": 0.1},
    )


@pytest.fixture(scope="module")
def uninterrupted(ray_session, tiny_dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("whole")
    sdk.train(spec_from_dict(job(tmp, tiny_dataset)), show_progress=False)
    run_dir = tmp / "runs" / "tiny"
    return step_rows(run_dir), step_rows(run_dir, "samples.jsonl")


# interval 40: the kill lands before the first checkpoint, so the restart begins at step 0.
@pytest.mark.parametrize("interval", [10, 40])
def test_killed_rank_restarts_from_checkpoint_with_identical_losses_and_samples(uninterrupted, ray_session, tiny_dataset, tmp_path, interval):
    reference, reference_samples = uninterrupted
    run_dir = tmp_path / "runs" / "tiny"
    killed = []
    watcher = when_step_reached(run_dir, 5, lambda: killed.append(kill_one_rank_process()))
    summary = sdk.train(spec_from_dict(job(tmp_path, tiny_dataset, interval)), show_progress=False)
    watcher.join(timeout=5)
    assert killed, "the rank was never killed"
    assert summary["final_step"] == STEPS and summary["failures"] == 1
    failure, recovered = events(run_dir)
    assert failure["event"] == "failure" and failure["step"] >= 5 and "ActorDiedError" in failure["cause"]
    assert recovered["event"] == "recovered" and recovered["seconds"] > 0 and recovered["steps_redone"] >= 0
    losses = step_rows(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert losses[step]["loss"] == pytest.approx(reference[step]["loss"], rel=1e-5), step
    # Every step trained exactly the samples of the uninterrupted order.
    samples = {step: row["ids"] for step, row in step_rows(run_dir, "samples.jsonl").items()}
    assert samples == {step: row["ids"] for step, row in reference_samples.items()}
    order = GlobalOrder(read_manifest(tiny_dataset)["num_samples"], seed=1, block=read_manifest(tiny_dataset)["shard_samples"], window=16)
    assert samples == {step: order.ids((step - 1) * 8, 8).tolist() for step in range(1, STEPS + 1)}


def test_hung_rank_is_detected_and_the_run_restarts(uninterrupted, ray_session, tiny_dataset, tmp_path):
    """SIGSTOP one rank: its peers block in their next collective; with
    fault_tolerance.step_timeout_s the controller calls it a hang, kills the group
    and restarts from the latest checkpoint."""
    import os
    import signal

    reference, _ = uninterrupted
    run_dir = tmp_path / "runs" / "tiny"
    stopped = []
    watcher = when_step_reached(run_dir, 5, lambda: stopped.append(kill_one_rank_process(sig=signal.SIGSTOP)))
    spec = spec_from_dict(job(tmp_path, tiny_dataset), ["fault_tolerance.step_timeout_s=3"])
    try:
        summary = sdk.train(spec, show_progress=False)
    finally:
        watcher.join(timeout=5)
        for pid in stopped:  # normally already killed by the teardown
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert stopped and summary["final_step"] == STEPS and summary["failures"] == 1
    failure, _ = events(run_dir)
    assert failure["cause"].startswith("RankHung: no step for")
    losses = step_rows(run_dir)
    for step in range(1, STEPS + 1):
        assert losses[step]["loss"] == pytest.approx(reference[step]["loss"], rel=1e-5), step
