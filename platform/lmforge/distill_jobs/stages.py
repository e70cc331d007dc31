"""`lmforge distill run PIPELINE.yaml`: progressive distillation. Stages run in order
(train: a job, a logits or layer distillation among them; instruct: the teachers'
answers, then the student on them; evaluate: the student on held-out prompts;
harness: the student on lm-evaluation-harness tasks), each
starting from the previous stage's student, all nested under one MLflow run. A
finished stage is recorded in `<output_dir>/<name>/pipeline.json`; a rerun skips it
and resumes the stage that stopped.

    name: progressive
    stages:
      - {name: general, kind: train, job: distill-logits.yaml}
      - {name: task, kind: instruct, job: distill-instruct.yaml, set: [train.max_steps=50]}
      - {name: check, kind: evaluate, job: distill-instruct.yaml}
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console

from lmforge.checkpoint.export import export_model
from lmforge.console import plain, text_console
from lmforge.credentials import redact_uri
from lmforge.data.manifest import has_manifest
from lmforge.distill.cache_manifest import is_built
from lmforge.distill_jobs.instruct.evaluate import ANSWERS_FILE, evaluate_student
from lmforge.distill_jobs.pipeline_file import Stage, load_pipeline
from lmforge.errors import UserError
from lmforge.jsonfile import read_object
from lmforge.ray_runtime import joined
from lmforge.tracking.pipeline_run import PipelineRun

if TYPE_CHECKING:
    from lmforge.evaluation.harness import HarnessReport
    from lmforge.spec import JobSpec
    from lmforge.tracking.summary import RunSummary

STATE = "pipeline.json"


class StageResult(BaseModel):
    """A finished stage, as pipeline.json keeps it: a train or instruct stage's student
    and its training's summary (the fields `STAGE_SUMMARY` names); an evaluate stage's
    model, metrics and answers file (a harness stage's: lm-eval's output directory)."""

    model_config = ConfigDict(extra="ignore")

    identity: str  # the stage as it ran (its job and overrides): a changed stage is refused
    kind: str
    student: Optional[str] = None
    summary: Optional[dict[str, Any]] = None
    model: Optional[str] = None
    metrics: Optional[dict[str, float]] = None
    answers: Optional[str] = None

    @property
    def numbers(self) -> dict[str, Any]:
        """Its headline numbers: the training's summary and the evaluation's metrics."""
        return (self.summary or {}) | (self.metrics or {})


class PipelineRecord(BaseModel):
    """pipeline.json: the pipeline's MLflow run and each finished stage's result."""

    mlflow_run_id: Optional[str] = None
    stages: dict[str, StageResult] = Field(default_factory=dict)


class PipelineResult(BaseModel):
    """What `sdk.run_pipeline` returns: each stage's result (None: not run), the
    pipeline's directory and MLflow run."""

    pipeline: str
    directory: str
    stages: dict[str, Optional[StageResult]]
    mlflow_run_id: Optional[str] = None
    mlflow_tracking_uri: Optional[str] = None

    def as_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True) | {
            "stages": {n: r and r.model_dump(mode="json", exclude_none=True) for n, r in self.stages.items()}
        }


class PipelineState:
    """pipeline.json, read and written here only."""

    def __init__(self, directory: Path, source: Path, stages: list[Stage]):
        self.path = directory / STATE
        self.record = PipelineRecord.model_validate(read_object(self.path)) if self.path.is_file() else PipelineRecord()
        for stage in stages:
            done = self.record.stages.get(stage.entry.name)
            if done and done.identity != stage.identity:
                raise UserError(
                    f"{source}: {stage.label} changed since it finished ({self.path}); a stage is run once per pipeline: "
                    f"give the pipeline another name, or remove {directory} to run it all again"
                )

    def done(self, stage: Stage) -> Optional[StageResult]:
        return self.record.stages.get(stage.entry.name)

    def finish(self, stage: Stage, result: dict[str, Any]) -> StageResult:
        finished = StageResult(identity=stage.identity, kind=stage.entry.kind, **result)
        self.record.stages[stage.entry.name] = finished
        self.save()
        return finished

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        partial.write_text(self.record.model_dump_json(indent=2, exclude_none=True))
        os.replace(partial, self.path)


@dataclass(frozen=True)
class StageCalls:
    """The SDK calls a stage makes: the pipeline sits under the SDK, which hands them in."""

    train: Callable[..., RunSummary]
    build_cache: Callable[..., object]
    generate_answers: Callable[..., object]
    evaluate_harness: Callable[..., HarnessReport]


def run_pipeline(
    path: str | os.PathLike, calls: StageCalls, address: Optional[str] = None, show_progress: bool = True, console: Optional[Console] = None
) -> PipelineResult:
    """Run the pipeline's stages that have not finished; returns each stage's result and
    the pipeline's MLflow run."""
    console = console or text_console()
    pipeline, stages = load_pipeline(path)
    directory = Path(pipeline.output_dir).absolute() / pipeline.name
    state = PipelineState(directory, Path(path), stages)
    pending = any(not state.done(stage) for stage in stages)
    with joined(address) if pending else nullcontext():  # nothing left to run: no Ray
        tracker = PipelineRun(pipeline, stages[0].job, state.record.mlflow_run_id, Path(path)) if pipeline.tracking.enabled else None
        if tracker:
            state.record.mlflow_run_id = tracker.run_id
            state.save()
        status = "FAILED"
        try:
            for stage in stages:
                _run_stage(stage, len(stages), state, calls, show_progress, console, tracker)
            status = "FINISHED"
        finally:
            if tracker:
                tracker.finish(status)
    return PipelineResult(
        pipeline=pipeline.name,
        directory=str(directory),
        stages={s.entry.name: state.done(s) for s in stages},
        mlflow_run_id=tracker.run_id if tracker else None,
        mlflow_tracking_uri=redact_uri(stages[0].job.tracking_uri) if tracker else None,
    )


def _run_stage(stage: Stage, count: int, state: PipelineState, calls: StageCalls, show_progress: bool, console: Console, tracker) -> None:
    """One stage, unless it finished before: run, recorded in pipeline.json, logged to the pipeline's run."""
    done = state.done(stage)
    if done:
        line = f"stage {stage.index + 1}/{count} {stage.entry.name}: finished before" + (f"; its student: {done.student}" if done.student else "")
        console.print(plain(line), highlight=False, soft_wrap=True)
        return
    console.print(
        plain(f"stage {stage.index + 1}/{count} {stage.entry.name} ({stage.entry.kind}): {stage.entry.job}"), highlight=False, soft_wrap=True
    )
    job = stage.job.with_changes("tracking", parent_run_id=tracker.run_id) if tracker else stage.job
    finished = state.finish(stage, RUNNERS[stage.entry.kind](stage, job, calls, show_progress, console, tracker))
    if tracker:
        tracker.log_stage(stage, finished.numbers, finished.model_dump(mode="json", exclude={"summary"}, exclude_none=True))


# What a stage's result keeps of its training's summary (pipeline.json, the pipeline's MLflow run).
STAGE_SUMMARY = {
    "start_step",
    "final_step",
    "final_loss",
    "eval_loss",
    "eval_ppl",
    "eval_kl",
    "eval_top1",
    "run_dir",
    "latest_checkpoint",
    "mlflow_run_id",
    "mlflow_parent_run_id",
    "student_answers",
}


def _train(stage: Stage, job: JobSpec, calls: StageCalls, show_progress: bool, console: Console, tracker) -> dict:
    if job.distill and job.distill.cache and not is_built(job.distill.cache):
        calls.build_cache(job, show_progress=show_progress)
    summary = calls.train(job, show_progress=show_progress, console=console)
    return _with_student(stage, summary)


def _instruct(stage: Stage, job: JobSpec, calls: StageCalls, show_progress: bool, console: Console, tracker) -> dict:
    if not has_manifest(job.data.path):
        calls.generate_answers(job, show_progress=show_progress)
    summary = calls.train(job, show_progress=show_progress, console=console)
    return _with_student(stage, summary)


def _with_student(stage: Stage, summary: RunSummary) -> dict:
    """The stage's final checkpoint exported as the next stage's starting model."""
    if stage.student.exists():  # an export an interruption left unfinished
        shutil.rmtree(stage.student)
    stage.student.parent.mkdir(parents=True, exist_ok=True)
    if summary.latest_checkpoint is None:
        raise UserError(f"{stage.label}: its training wrote no checkpoint to export as the next stage's student")
    export_model(summary.latest_checkpoint, str(stage.student))
    return {"student": str(stage.student), "summary": summary.model_dump(mode="json", include=STAGE_SUMMARY, exclude_none=True)}


def _evaluate(stage: Stage, job: JobSpec, calls: StageCalls, show_progress: bool, console: Console, tracker) -> dict:
    answered = evaluate_student(job, str(stage.previous_student), job.distill.instruct.eval_answers or 32)
    out = Path(job.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ANSWERS_FILE, "w") as table:
        table.writelines(json.dumps(row) + "\n" for row in answered["table"])
    m = answered["metrics"]
    console.print(
        plain(
            f"  {stage.previous_student}: NLL of the teachers' held-out answers {m['answers_nll']:.4f} "
            f"({m['answer_tokens']} tokens); answered {m['held_out_prompts']} held-out prompts, {m['student_answer_tokens']:.1f} "
            f"tokens on average, {m['student_finish_stop']:.0%} ended by itself -> {out / ANSWERS_FILE}"
        ),
        highlight=False,
        soft_wrap=True,
    )
    if tracker:
        tracker.log_evaluation(stage, answered)
    return {"model": str(stage.previous_student), "metrics": m, "answers": str(out / ANSWERS_FILE)}


def _harness(stage: Stage, job: JobSpec, calls: StageCalls, show_progress: bool, console: Console, tracker) -> dict:
    """lm-eval's tasks on the previous student, on the job's tensor x pipeline layout;
    lm-eval's files in the stage's run directory, the metrics in the pipeline's run."""
    assert stage.entry.harness is not None and stage.previous_student is not None  # load_pipeline's checks
    settings, out = stage.entry.harness, Path(job.run_dir) / "harness"
    report = calls.evaluate_harness(
        str(stage.previous_student),
        settings.tasks,
        include_path=settings.include_path,
        num_fewshot=settings.num_fewshot,
        limit=settings.limit,
        batch_size=settings.batch_size,
        out=str(out),
        tracking=False,
        tp=job.parallel.tp,
        pp=job.parallel.pp,
        say=lambda line: console.print(plain(f"  {line}"), highlight=False, soft_wrap=True),
    )
    metrics = {f"harness/{task}/{name.replace(',', '/')}": float(value) for task, values in report.results.items() for name, value in values.items()}
    for name, value in metrics.items():
        console.print(plain(f"  {name} {value:.4g}"), highlight=False, soft_wrap=True)
    return {"model": str(stage.previous_student), "metrics": metrics, "answers": str(out)}


RUNNERS = {"train": _train, "instruct": _instruct, "evaluate": _evaluate, "harness": _harness}
