"""Faults on one node, each against the run that nothing interrupted: a rank's
process killed or hung, a rank killed while a checkpoint is being written, a
committed shard corrupted, a checkpoint directory refusing writes for a while, the
controller or the driver killed. Scenarios that do not get in each other's way
share a run (each run is seconds of start-up for a second of training).
Each run must end as if nothing had happened: the same losses and every sample
exactly once, in the uninterrupted order."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ray.util.placement_group import placement_group_table

from chaos import (
    Condition,
    actor_processes,
    committed,
    events,
    kill_one_rank_process,
    reached_step,
    same_as_uninterrupted,
    step_rows,
    wait_until,
    when,
    when_step_reached,
)
from cli import assert_clean_error, run_cli
from conftest import DISTILL_STEPS, REFERENCE_STEPS, distill_job, reference_job, tensorboard_scalars, with_sections
from lmforge import sdk
from lmforge.checkpoint.store import CheckpointStore
from lmforge.data.manifest import read_manifest
from lmforge.data.order import GlobalOrder
from lmforge.errors import TrainingFailed
from lmforge.spec import spec_from_dict
from lmforge.tracking.summary import RunSummary

pytestmark = [pytest.mark.ray, pytest.mark.slow]
SLOW_S = 0.5  # how long the straggler dawdles
STEPS = REFERENCE_STEPS


def chaos_job(tmp_path, tiny_dataset, **checkpoint):
    return reference_job(tmp_path, tiny_dataset, checkpoint=checkpoint)


@pytest.fixture(scope="module")
def uninterrupted(reference_run):
    """(losses by step, sample ids by step) of the job run straight through."""
    run_dir = Path(reference_run.run_dir)
    return step_rows(run_dir), step_rows(run_dir, "samples.jsonl")


def test_refused_writes_are_logged_then_a_hung_rank_is_detected_and_the_run_restarts(uninterrupted, ray_session, tiny_dataset, tmp_path):
    """The checkpoint directory refuses the writes of steps 10 and 20: each is
    logged and training goes on. When step 30 is committed, one rank is SIGSTOPped:
    its peers block in their next collective; with fault_tolerance.step_timeout_s the
    controller calls it a hang, kills the group and restarts from step 30."""
    import signal

    run_dir = tmp_path / "runs" / "tiny"
    _block_steps(run_dir, 10, 20)
    stopped = []
    watcher = when(committed(run_dir, 30), lambda: stopped.append(kill_one_rank_process(sig=signal.SIGSTOP)))
    # Rank 1 dawdles before step 5: the straggler report names it.
    overrides = ["fault_tolerance.step_timeout_s=3", "debug.slow_rank=1", "debug.slow_at_steps=[5]", f"debug.slow_s={SLOW_S}"]
    spec = spec_from_dict(chaos_job(tmp_path, tiny_dataset, max_failed_writes=3), overrides)
    try:
        summary = sdk.train(spec, show_progress=False)
    finally:
        watcher.join(timeout=5)
        for pid in stopped:  # normally already killed by the teardown
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert stopped and summary.final_step == STEPS and summary.failures == 1
    failed = _events(run_dir, "checkpoint_failed")
    assert [(event["step"], event["failed_in_a_row"]) for event in failed] == [(10, 1), (20, 2)]
    assert "step_00000010" in failed[0]["error"]
    (failure,) = _events(run_dir, "failure")
    assert failure["cause"].startswith("RankHung: no step for") and failure["step"] >= 30
    # The hang explains itself: the stopped rank is named, and every rank's stack is kept.
    (hang,) = _events(run_dir, "hang")
    assert hang["doing"].startswith(f"pid {stopped[0]}, stopped by a signal, in ") and f"rank {hang['behind']} is behind" in failure["cause"]
    assert failure["rank"] == hang["behind"]
    stacks = Path(hang["report_path"]).read_text()
    assert stacks.count("== rank ") == 2 and f"pid {stopped[0]}, T (stopped)" in stacks
    assert "(lmforge/trainer.py:" in stacks or "lmforge/trainer.py" in stacks, stacks[-2000:]
    assert _restored_steps(run_dir) == [30]
    assert CheckpointStore(str(run_dir / "checkpoints")).committed() == [40, 50, 60]
    same_as_uninterrupted(run_dir, uninterrupted)
    slow = step_rows(run_dir)[5]
    assert slow["straggler"] == 1 and slow["rank_between_s"][1] >= SLOW_S and slow["straggle_s"] > SLOW_S / 2, slow


def _events(run_dir, kind):
    return [event for event in events(run_dir) if event["event"] == kind]


def _restored_steps(run_dir):
    return [event["step"] for event in _events(run_dir, "restored")]


def test_rank_killed_while_a_checkpoint_is_written_restores_the_one_before(uninterrupted, ray_session, tiny_dataset, tmp_path):
    """Rank 1's write of step 20 hangs (its RNG file is a FIFO nobody reads, like a
    stuck storage mount) while training goes on; a rank is killed then. Step 20
    was never committed, so the restart restores step 10. The job says
    `checkpoint.resume: false`: that is where it starts, not where a restart goes."""
    run_dir = tmp_path / "runs" / "tiny"
    step_20 = run_dir / "checkpoints" / "step_00000020"

    def hang_the_write():
        (step_20 / "rng").mkdir(parents=True)
        os.mkfifo(step_20 / "rng" / "rank_00001.safetensors")

    killed = []

    def kill_mid_write():
        assert not (step_20 / "commit.json").exists()
        killed.append(kill_one_rank_process())

    watchers = [when_step_reached(run_dir, 3, hang_the_write), when_step_reached(run_dir, 24, kill_mid_write)]
    board = tmp_path / "tensorboard"
    summary = sdk.train(spec_from_dict(chaos_job(tmp_path, tiny_dataset, resume=False), [f"tracking.tensorboard={board}"]), show_progress=False)
    for watcher in watchers:
        watcher.join(timeout=5)
    assert killed and summary.final_step == STEPS and summary.failures == 1
    (failure,), (recovered,) = _events(run_dir, "failure"), _events(run_dir, "recovered")
    assert failure["step"] >= 24 and "ActorDiedError" in failure["cause"]
    assert recovered["seconds"] > 0 and recovered["steps_redone"] >= 14
    assert _restored_steps(run_dir) == [10]
    # The rank's node lives on, and so does the job's data reader: laid out anew, not restarted.
    assert [event["kept"] for event in _events(run_dir, "reader")] == [False, True]
    same_as_uninterrupted(run_dir, uninterrupted)
    # TensorBoard shows each step once, the retrained ones in place of the first tries.
    scalars, rows = tensorboard_scalars(board), step_rows(run_dir)
    assert [step for step, _ in scalars["loss"]] == list(range(1, STEPS + 1))
    assert all(value == pytest.approx(rows[step]["loss"], rel=1e-6) for step, value in scalars["loss"])
    assert [step for step, _ in scalars["eval_loss"]] == [event["step"] for event in _events(run_dir, "eval")]


def test_a_restart_restores_the_in_memory_snapshot_and_keeps_the_surviving_rank(uninterrupted, ray_session, tiny_dataset, tmp_path):
    """checkpoint.in_memory, a snapshot every step: past step 24 every committed
    storage checkpoint's shards are overwritten (a restore from storage would find
    them corrupt) and a rank is killed. The restart restores the newest snapshot
    from memory, redoing at most a step or two; the surviving rank's process is kept
    and re-ranked, and the run ends as if nothing had happened."""
    run_dir = tmp_path / "runs" / "tiny"
    killed = []

    def spoil_storage_then_kill():
        for shard in (run_dir / "checkpoints").glob("step_*/*.distcp"):
            shard.write_bytes(b"\0" * shard.stat().st_size)
        killed.append(kill_one_rank_process())

    watcher = when_step_reached(run_dir, 24, spoil_storage_then_kill)
    summary = sdk.train(spec_from_dict(chaos_job(tmp_path, tiny_dataset, in_memory=True, memory_interval=1)), show_progress=False)
    watcher.join(timeout=5)
    assert killed and summary.final_step == STEPS and summary.failures == 1
    (failure,), (restored,), (recovered,) = _events(run_dir, "failure"), _events(run_dir, "restored"), _events(run_dir, "recovered")
    assert restored["from_memory"] and restored["step"] >= 23 and not _events(run_dir, "checkpoint_corrupt")
    assert restored["step"] == failure["step"] - recovered["steps_redone"] and recovered["steps_redone"] <= 2
    assert [event["reused"] for event in _events(run_dir, "layout")] == [0, 1]
    same_as_uninterrupted(run_dir, uninterrupted)


def _block_steps(run_dir, *steps):
    """Make the checkpoint directory refuse the writes of these steps: a file where
    the step's directory would go (permissions would not stop root)."""
    ckpt = run_dir / "checkpoints"
    ckpt.mkdir(parents=True)
    for step in steps:
        (ckpt / f"step_{step:08d}").write_text("in the way\n")


def test_too_many_failed_writes_in_a_row_fail_the_job_without_a_restart(ray_session, tiny_dataset, tmp_path):
    run_dir = tmp_path / "runs" / "tiny"
    _block_steps(run_dir, 10, 20)
    with pytest.raises(TrainingFailed, match="2 checkpoints in a row could not be written.*max_failed_writes 2"):
        sdk.train(spec_from_dict(chaos_job(tmp_path, tiny_dataset, max_failed_writes=2)), show_progress=False)
    assert not _events(run_dir, "failure")


def test_killed_controller_is_replaced_and_a_corrupt_latest_checkpoint_is_passed_over(uninterrupted, ray_session, tiny_dataset, tmp_path):
    """Past step 20's commit, a byte of a shard of the newest committed checkpoint
    flips and the controller's process dies at once: its ranks go with it (Ray
    fate-shares actors with their owner), and the driver starts a new controller.
    Its restart finds that checkpoint's checksums wrong, says so, restores the one
    before it, and the run ends as if nothing had happened. Before all that, step 15
    ran out of memory (injected) and the first controller went on with half the
    micro-batch: the replacement starts from the job as it became, so step 15 does
    not run out of memory again."""
    run_dir = tmp_path / "runs" / "tiny"
    ckpt = run_dir / "checkpoints"
    corrupted = []

    def corrupt_and_kill():
        controller = actor_processes("Controller")[0]  # found first: the kill follows the corruption at once
        newest = max(path for path in ckpt.glob("step_*") if (path / "commit.json").exists())
        shard = sorted(newest.glob("__*_*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        controller.kill()
        corrupted.append(int(newest.name.split("_")[1]))

    # The driver has seen step 20 too: what it has not drained dies with the controller.
    watcher = when(committed(run_dir, 20) & reached_step(run_dir, 20), corrupt_and_kill)
    job = with_sections(chaos_job(tmp_path, tiny_dataset), {"debug": {"oom_at_step": 15, "oom_above_micro_batch": 1}})
    summary = sdk.train(spec_from_dict(job), show_progress=False)
    watcher.join(timeout=5)
    assert corrupted and summary.final_step == STEPS and summary.failures == 1
    assert [(e["step"], e["micro_batch"], e["retry_micro_batch"]) for e in _events(run_dir, "out_of_memory")] == [(15, 2, 1)]
    oom_retry, restored = _restored_steps(run_dir)
    assert oom_retry == 10 and restored == corrupted[0] - 10
    (failure,), (recovered,) = _events(run_dir, "failure"), _events(run_dir, "recovered")
    assert failure["cause"].startswith("the controller died") and failure["step"] >= 20
    # The replacement counts what it redoes from the last step the driver saw.
    assert recovered["seconds"] > 0 and recovered["steps_redone"] == max(0, failure["step"] - restored)
    corrupt = _events(run_dir, "checkpoint_corrupt")
    assert [event["step"] for event in corrupt] == corrupted and ".distcp" in corrupt[0]["reason"]
    assert (ckpt / f"corrupt_step_{corrupted[0]:08d}" / "commit.json").exists()  # set aside whole, not deleted
    same_as_uninterrupted(run_dir, uninterrupted, rel=1e-4)  # micro-batch 1 sums its accumulation in another order
    # ... which is the order GlobalOrder defines, whatever dp read it.
    samples = {step: row["ids"] for step, row in step_rows(run_dir, "samples.jsonl").items()}
    manifest = read_manifest(tiny_dataset)
    order = GlobalOrder(manifest.num_samples, seed=1, block=manifest.shard_samples, window=16)
    assert samples == {step: order.ids((step - 1) * 8, 8).tolist() for step in range(1, STEPS + 1)}
    # The dead controller's placement group was removed (Ray would keep it until the job ends).
    live = [pg["name"] for pg in placement_group_table().values() if pg["state"] != "REMOVED"]
    assert not [name for name in live if name.startswith("lmforge/")], live


def test_resubmitted_job_resumes_after_its_driver_was_killed(uninterrupted, ray_session, tiny_dataset, tmp_path):
    """`lmforge train` (the driver, as under `ray job submit`) is SIGKILLed mid-run;
    its controller and ranks die with it. The same job submitted again resumes from
    the last checkpoint and continues the same MLflow run. While the first driver
    ran, a second one of the same job was refused (the job's lease), and the killed
    driver's lease did not hold the resubmission up."""
    from mlflow.tracking import MlflowClient

    job_file, run_dir = tmp_path / "job.yaml", tmp_path / "runs" / "tiny"
    job_file.write_text(yaml.safe_dump(reference_job(tmp_path, tiny_dataset, tracking={"experiment": "resubmitted"})))
    command = [sys.executable, "-m", "lmforge", "train", str(job_file), "--no-progress", "--address", ray_session.get_runtime_context().gcs_address]
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(reached_step(run_dir, 15), timeout_s=120)
        second = run_cli("train", str(job_file), "--no-progress", cwd=tmp_path)
        assert_clean_error(second, f"name: job tiny is already being trained by pid {driver.pid}")
    finally:
        driver.kill()
        driver.wait()
    wait_until(
        Condition(lambda: not actor_processes("Worker") and not actor_processes("Controller"), "the killed driver's actors to exit"), timeout_s=60
    )
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = RunSummary.model_validate_json((run_dir / "summary.json").read_text())
    assert summary.start_step >= 10 and summary.start_step % 10 == 0 and summary.final_step == STEPS
    same_as_uninterrupted(run_dir, uninterrupted)
    client = MlflowClient(summary.mlflow_tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("resubmitted").experiment_id])
    assert run.info.run_id == summary.mlflow_run_id and run.info.status == "FINISHED"
    assert {m.step for m in client.get_metric_history(run.info.run_id, "loss")} == set(range(1, STEPS + 1))


def test_a_rank_killed_mid_distillation_resumes_with_identical_losses(distill_run, reference_run, ray_session, tiny_dataset, tmp_path):
    """The teachers are rebuilt from their paths on the restart (they are never
    checkpointed): from step 4's checkpoint on, every step's loss and terms, and the
    held-out KL, are those of the run nothing interrupted."""
    job, straight = distill_run
    run_dir = tmp_path / "runs" / "distill"
    killed = []
    watcher = when(committed(run_dir, 4), lambda: killed.append(kill_one_rank_process()))
    summary = sdk.train(spec_from_dict(distill_job(tmp_path, tiny_dataset, Path(reference_run.run_dir))), show_progress=False)
    watcher.join(timeout=5)
    assert killed and summary.failures == 1 and summary.final_step == DISTILL_STEPS
    assert _restored_steps(run_dir) == [4]
    want, got = step_rows(Path(straight.run_dir)), step_rows(run_dir)
    assert sorted(got) == sorted(want)
    for term in ("loss", "ce_loss", "kd_loss"):
        assert {step: row[term] for step, row in got.items()} == pytest.approx({step: row[term] for step, row in want.items()}, rel=1e-6)
    assert summary.eval_kl == pytest.approx(straight.eval_kl, rel=1e-6)
