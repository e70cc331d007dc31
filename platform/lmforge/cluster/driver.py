"""The driver: runs one job on a cluster it joins (or starts). It starts the
controller, replaces it if it dies, routes its events to the console, the run
directory, MLflow and an optional event stream, and writes the summary."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from rich.console import Console

from lmforge.checkpoint.store import CheckpointStore
from lmforge.cluster import placement
from lmforge.cluster.capacity import check_placement
from lmforge.cluster.controller import Controller
from lmforge.cluster.supervision import FailureBudget, Handoff
from lmforge.console import plain, text_console
from lmforge.credentials import redact_uri
from lmforge.data.manifest import Manifest, read_manifest
from lmforge.data.prepare import prepare_dataset
from lmforge.data.prepare_options import PrepareOptions
from lmforge.distill.cache_manifest import tracking_params
from lmforge.distill_jobs.instruct.evaluate import after_training
from lmforge.errors import TrainingFailed, UserError, first_line
from lmforge.events import (
    EVENT_PREFIX,
    Checkpoint,
    DataChanged,
    Eval,
    Event,
    Failure,
    JobResult,
    Layout,
    OutOfMemoryEvent,
    Rollback,
    Start,
    Step,
    WithReport,
)
from lmforge.lease import JobLease
from lmforge.memory.snapshots import check_host_memory
from lmforge.preflight import Plan, check_dataset, check_fresh_start, check_resume_order
from lmforge.ray_runtime import check_capacity, embedded_resources, joined
from lmforge.spec import JobSpec
from lmforge.tracking.mlflow_run import MlflowRun
from lmforge.tracking.progress import ProgressView
from lmforge.tracking.run_dir import STEP_FIELDS, RunDir
from lmforge.tracking.summary import RunSummary
from lmforge.tracking.tensorboard import TensorBoardLog


def drive(
    plan: Plan, address: Optional[str] = None, show_progress: bool = True, console: Optional[Console] = None, stream_events: bool = False
) -> RunSummary:
    """Run a preflighted job to `train.max_steps`; returns the summary. `stream_events`:
    also print each step, recorded event and the summary on stdout as an event line,
    for a client following the job through its logs (`lmforge.jobs`)."""
    console = console or text_console()
    spec = plan.spec
    publish = _print_event if stream_events else None
    embedded = embedded_resources(address)
    if embedded is not None:
        _check_capacity(spec, embedded)  # before starting a cluster it would not fit
    with JobLease(spec.checkpoint_dir, spec.name) as lease:  # a second driver of this job, or of its checkpoints, is refused here
        with joined(address):
            _check_capacity(spec)
            check_placement(spec)
            if spec.checkpoint.in_memory:
                check_host_memory(spec, ray.nodes())
            _start_over(spec, console)  # after the checks: a refused job deletes nothing
            manifest = _ensure_dataset(plan, console, show_progress)
            summary = _run(plan, manifest, console, show_progress, lease, publish)
    if publish:
        publish({"event": "summary", **summary.as_json()})
    return summary


def _start_over(spec: JobSpec, console: Console) -> None:
    """Under the lease, a `checkpoint.resume: false` job finds its directory as pre-flight
    did (another driver may have written since), and empties it only when told to."""
    if spec.checkpoint.resume:
        return
    store = CheckpointStore(spec.checkpoint_dir)
    check_fresh_start(spec, store)
    removed = store.remove_steps() if spec.checkpoint.discard_existing else []
    if removed:
        console.print(
            plain(
                f"checkpoint.discard_existing: deleted {len(removed)} checkpoint directories (steps {removed[0]}..{removed[-1]}) "
                f"from {spec.checkpoint_dir}; starting at step 0"
            ),
            highlight=False,
        )


def _print_event(row: dict) -> None:
    print(EVENT_PREFIX + json.dumps(row, default=str), file=sys.stdout, flush=True)


def _check_capacity(spec: JobSpec, total: Optional[dict] = None) -> None:
    """The job's ranks and spares must fit (`total`: the resources of a cluster not
    started yet); an elastic job's smallest layout must."""
    res, spares = spec.resources, spec.fault_tolerance.spares
    if spec.elastic is None:
        check_capacity(spec.world_size + spares, res.cpus_per_worker, res.gpus_per_worker, total=total)
        return
    smallest = spec.parallel.pp * spec.parallel.tp * spec.elastic.min_dp
    check_capacity(
        smallest + spares,
        res.cpus_per_worker,
        res.gpus_per_worker,
        field="elastic.min_dp",
        total=total,
        hint=f"even dp {spec.elastic.min_dp}{' with ' + str(spares) + ' spares' if spares else ''} does not fit; lower elastic.min_dp or join a larger cluster",
    )


def _ensure_dataset(plan: Plan, console: Console, show_progress: bool) -> Manifest:
    if plan.manifest is not None:
        return plan.manifest
    spec = plan.spec
    console.print(plain(f"preparing {spec.data.source} into {spec.data.path}"), highlight=False)
    prepare_dataset(PrepareOptions.for_job(spec, show_progress=show_progress))
    manifest = read_manifest(spec.data.path)
    check_dataset(spec, manifest)
    if plan.resume_from:
        plan.order_changes = check_resume_order(spec, manifest, plan.resume_from)
    return manifest


def _run(
    plan: Plan, manifest: Manifest, console: Console, show_progress: bool, lease: JobLease, publish: Optional[Callable[[dict], None]]
) -> RunSummary:
    spec = plan.spec
    run_dir = RunDir(spec.run_dir)
    run_dir.rewind(plan.start_step)
    if plan.resume_from:
        run_dir.restore_records(plan.resume_from.state.records)
    skipped = sorted(set(run_dir.skip_batches()) | set(spec.guards.skip_batches)) if plan.resume_from else []
    if skipped:
        spec = spec.with_changes("guards", skip_batches=skipped)  # what earlier rollbacks of this run skipped
    tracker = None
    if spec.tracking.enabled:
        tracker = MlflowRun(spec, more_params=lambda: tracking_params(spec))
        tracker.catch_up(run_dir.steps())
        tracker.log_dataset(manifest)
        spec = spec.with_changes("tracking", run_id=tracker.run_id)  # for the ranks' system metrics and checkpoints
    board = TensorBoardLog(spec.tracking.tensorboard, plan.start_step) if spec.tracking.tensorboard else None
    began = time.time()
    view = ProgressView(spec.train.max_steps, plan.start_step, console=console, enabled=show_progress)
    if plan.resume_from:
        view.print(f"resuming {spec.name} from step {plan.start_step} ({plan.resume_from.path})")
    seen = Seen(spec, latest_checkpoint=plan.resume_from.path if plan.resume_from else None)
    handle = lambda event: seen.add(event, _handle(event, view, run_dir, tracker, publish, board))
    if plan.order_changes:
        handle(DataChanged(step=plan.start_step, path=plan.resume_from.path, changes=plan.order_changes))
    status, handoff = "FAILED", None
    try:
        with view:
            while True:
                controller = _start_controller(seen.spec, manifest, handoff)
                try:
                    result = _follow(controller, handle, lease)
                    break
                except ray.exceptions.RayActorError as err:
                    # The controller itself died: its ranks went with it (Ray's owner
                    # fate-sharing); a new one resumes from the latest checkpoint.
                    budget = FailureBudget.of(spec.fault_tolerance, seen.failures)  # the controller's failures too
                    if budget.used_up:
                        raise TrainingFailed(
                            f"the controller died ({first_line(err)}); fault_tolerance.max_failures {budget.max_failures} is used up"
                        ) from None
                    step = seen.last.step if seen.last else plan.start_step
                    handoff = seen.handoff(step)
                    attempt = budget.spend()
                    handle(
                        Failure(
                            attempt=attempt,
                            max_failures=budget.max_failures,
                            step=step,
                            cause=f"the controller died ({type(err).__name__})",
                            rank=None,
                            nodes_lost=[],
                        )
                    )
                    budget.wait()
                finally:
                    ray.kill(controller)
                    # Its placement groups belong to the job, not to it: whatever it
                    # did not release (it died, or failed mid-reservation) goes now.
                    placement.release_orphans(placement.owner_prefix(spec.name, controller._actor_id.hex()))
        status = "FINISHED"
    except ray.exceptions.RayTaskError as err:
        raise _failure(err, run_dir) from None
    finally:
        if tracker and lease.taken_by is None:  # else the MLflow run is the other driver's now
            tracker.finish(status)
        if board:
            board.close()
    last_eval = seen.last_eval
    summary = RunSummary(
        job=spec.name,
        final_step=result.step,
        final_loss=seen.last.loss if seen.last else None,
        eval_loss=last_eval.eval_loss if last_eval else None,
        eval_ppl=last_eval.eval_ppl if last_eval else None,
        eval_step=last_eval.step if last_eval else None,
        eval_kl=last_eval.eval_kl if last_eval else None,
        eval_top1=last_eval.eval_top1 if last_eval else None,
        start_step=plan.start_step,
        tokens=result.step * spec.train.global_batch * spec.train.seq_len,
        wall_seconds=round(time.time() - began, 2),
        first_step_data_wait_seconds=seen.waits.first_seconds,
        data_wait_fraction=seen.waits.fraction,
        world_size=result.world_size,
        dp=result.dp,
        data_bytes_read=result.data_bytes_read,
        failures=seen.failures,
        ranks=seen.ranks,
        run_dir=os.path.abspath(spec.run_dir),
        latest_checkpoint=seen.latest_checkpoint,
        mlflow_tracking_uri=redact_uri(spec.tracking_uri) if tracker else None,
        mlflow_run_id=tracker.run_id if tracker else None,
        mlflow_parent_run_id=tracker.parent_id if tracker else None,
    )
    answered = _student_answers(spec, seen.latest_checkpoint, run_dir, view)
    if answered:
        summary.student_answers = answered["metrics"]
    run_dir.write_summary(summary)
    if tracker and seen.last_eval and seen.last_eval.step == result.step:
        tracker.log_evaluation(seen.last_eval, run_dir.summary_path, answered)  # a distillation's: its own child run
    return summary


def _student_answers(spec: JobSpec, checkpoint: Optional[str], run_dir: RunDir, view: ProgressView) -> Optional[dict]:
    """An instruction distillation's trained student answering its held-out prompts."""

    if checkpoint is None or not (spec.distill and spec.distill.instruct):
        return None
    answered = after_training(spec, checkpoint, run_dir.path)
    if answered:
        m = answered["metrics"]
        view.print(
            f"held-out prompts: the student's NLL of its teachers' answers {m['answers_nll']:.4f}; it answered "
            f"{m['held_out_prompts']} of them greedily, {m['student_answer_tokens']:.1f} tokens on average, "
            f"{m['student_finish_stop']:.0%} ended by itself ({run_dir.path / 'student_answers.jsonl'})"
        )
    return answered


def _follow(controller, handle, lease: JobLease) -> JobResult:
    """Run the job on this controller, passing each of its events to `handle`; stop
    (the controller goes with the caller's cleanup) if another driver took the job."""
    done = controller.run.remote()
    while True:
        lease.check()
        ready, _ = ray.wait([done], timeout=0.5)
        for event in _drain(controller):
            handle(event)
        if ready:
            result = ray.get(done)
            for event in _drain(controller):
                handle(event)
            return result


@dataclass
class Seen:
    """What the driver keeps from the events: the summary's figures, and the job as
    the guards changed it (a replacement controller starts from that, not from the
    job as submitted, or it would repeat the rollback or out-of-memory)."""

    spec: JobSpec
    latest_checkpoint: Optional[str] = None
    last: Optional[Step] = None
    last_eval: Optional[Eval] = None
    ranks: list = field(default_factory=list)
    failures: int = 0
    rollbacks: int = 0
    waits: "WaitTally" = field(default_factory=lambda: WaitTally())

    def add(self, event: Event, checkpoint_path: Optional[str]) -> None:
        self.latest_checkpoint = checkpoint_path or self.latest_checkpoint
        if isinstance(event, Step):
            self.last = event
            self.waits.add(event)
        elif isinstance(event, Eval):
            self.last_eval = event
        elif isinstance(event, Layout):
            self.ranks = event.ranks
        elif isinstance(event, Failure):
            self.failures += 1
        elif isinstance(event, Rollback):
            self.rollbacks = event.rollback
            self.spec = self.spec.with_changes("guards", skip_batches=event.skip_batches)
        elif isinstance(event, OutOfMemoryEvent) and event.retry_micro_batch:
            self.spec = self.spec.with_micro_batch(event.retry_micro_batch)

    def handoff(self, step: int) -> Handoff:
        """What a replacement controller continues from, the death of the one before counted."""
        return Handoff(failures=self.failures + 1, rollbacks=self.rollbacks, step=step, failed_at=time.time())


def _start_controller(spec: JobSpec, manifest: Manifest, handoff: Optional[Handoff]):
    # The controller lives next to the driver, so losing a worker node never takes it along.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return Controller.options(scheduling_strategy=here).remote(spec.model_dump(mode="json", exclude_unset=True), manifest, handoff=handoff)


def _drain(controller) -> list[Event]:
    """The controller's new events; none this time if it is briefly unreachable (a
    node leaving the cluster can interrupt connections for a moment). A controller
    that is really gone fails the `run` call, which the caller waits on."""
    try:
        return ray.get(controller.drain.remote())
    except ray.exceptions.ActorUnavailableError:
        return []


def _failure(err: ray.exceptions.RayTaskError, run_dir: RunDir) -> Exception:
    cause = err.cause if isinstance(err.cause, BaseException) else err
    if isinstance(cause, (UserError, TrainingFailed)):
        return cause
    path = run_dir.path / "error.txt"
    path.write_text(str(err))
    return TrainingFailed(f"{type(cause).__name__}: {first_line(cause)} (traceback in {path})")


class WaitTally:
    """Time the trainer waited on data, as a share of step time. The first step of
    a launch also waits for the reader to start, so it is reported apart."""

    def __init__(self):
        self.first_wait, self.wait, self.step_time, self.steps = None, 0.0, 0.0, 0

    def add(self, event: Step) -> None:
        if self.first_wait is None:
            self.first_wait = event.data_wait
            return
        self.wait += event.data_wait
        self.step_time += event.step_time
        self.steps += 1

    @property
    def first_seconds(self) -> float:
        return round(self.first_wait or 0.0, 3)

    @property
    def fraction(self) -> Optional[float]:
        return round(self.wait / self.step_time, 5) if self.step_time else None


def _handle(
    event: Event,
    view: ProgressView,
    run_dir: RunDir,
    tracker: Optional[MlflowRun],
    publish: Optional[Callable[[dict], None]],
    board: Optional[TensorBoardLog] = None,
) -> Optional[str]:
    """Route one event from the controller; returns a checkpoint path when one was committed."""
    if isinstance(event, Step):
        row = event.as_dict()
        run_dir.append_step(row)
        if publish:
            publish({k: row[k] for k in STEP_FIELDS if k in row})
        view.step(event)
        if tracker:
            tracker.log_step(row)
        if board:
            board.scalars(event.metrics(), event.step, event.time)
        return None
    if isinstance(event, WithReport) and event.report is not None:  # a file in the run directory, and an MLflow artifact
        path = run_dir.write_report(event.report_name or f"{event.event}-report.txt", event.report)
        event = event.model_copy(update={"report": None, "report_path": str(path)})
        if tracker:
            tracker.log_artifact(path)
    if isinstance(event, Start):
        run_dir.rewind(event.step)
        if board:
            board.rewind(event.step)
    elif isinstance(event, Rollback):
        run_dir.record_skip_batches(event.skip_batches)
    elif isinstance(event, Layout):
        view.layout(event.ranks)
    elif isinstance(event, Eval):
        view.held_out(event)
    line = event.line()
    if line is not None:
        view.print(line)
    if event.recorded:
        run_dir.append_event(event.as_dict())
        if publish:
            publish(event.as_dict())
    step = getattr(event, "step", None)
    if tracker:
        for key, value in event.metrics().items():
            tracker.log_metric(key, value, step)
        for key, value in event.tags().items():
            tracker.set_tag(key, value)
    if board and step is not None:
        board.scalars(event.metrics(), step, event.time)
    return event.path if isinstance(event, Checkpoint) else None
