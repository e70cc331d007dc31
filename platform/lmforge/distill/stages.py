"""`lmforge distill run PIPELINE.yaml`: progressive distillation. Stages run in order
(train: a job, a logits or layer distillation among them; instruct: the teachers'
answers, then the student on them; evaluate: the student on held-out prompts), each
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

import dataclasses
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from rich.console import Console

from lmforge.credentials import redact_uri
from lmforge.data.manifest import has_manifest
from lmforge.distill.cache_manifest import is_built
from lmforge.errors import UserError, first_error
from lmforge.spec import JobSpec, TrackingSpec, load_spec
from lmforge.tracking.console import plain, text_console
from lmforge.tracking.summary import RunSummary

STATE = "pipeline.json"
NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
MAKES_STUDENT = ("train", "instruct")


class StageSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=NAME)
    kind: Literal["train", "instruct", "evaluate"] = Field(
        ...,
        description="train: train the job (building its teacher cache first if it names one); instruct: its teachers' "
        "answers (unless its dataset exists), then train on them; evaluate: the previous student on the job's held-out prompts",
    )
    job: str = Field(..., description="a job file, relative to the pipeline file")
    set: list[str] = Field(default_factory=list, description="overrides of the job's fields, KEY=VALUE")


class PipelineSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=NAME)
    output_dir: str = Field("runs", description="every stage's runs go here: <output_dir>/<name>-<stage>")
    tracking: TrackingSpec = Field(default_factory=TrackingSpec, description="replaces every stage job's tracking section")
    stages: list[StageSpec] = Field(..., min_length=1)

    @model_validator(mode="after")
    def _distinct_names(self) -> "PipelineSpec":
        names = [s.name for s in self.stages]
        again = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if again:
            raise ValueError(f"stages: two stages are named {again!r}; a stage's name names its runs and its student")
        return self


@dataclass
class Stage:
    index: int
    entry: StageSpec
    job: JobSpec  # with absolute paths and, after the first stage, the previous student as model.init_from
    identity: str  # a finished stage is skipped on a rerun only while this is unchanged
    student: Optional[Path]  # where this stage's student is written (evaluate: none)
    previous_student: Optional[Path]

    @property
    def label(self) -> str:
        return f"stages[{self.index}] ({self.entry.name})"


def load_pipeline(path: str | os.PathLike) -> tuple[PipelineSpec, list[Stage]]:
    """The pipeline and its stages' jobs, every refusal made before anything runs."""
    path = Path(path)
    pipeline = _read(path)
    out = Path(pipeline.output_dir).absolute() / pipeline.name
    stages: list[Stage] = []
    student: Optional[Stage] = None  # the latest stage that makes one
    for index, entry in enumerate(pipeline.stages):
        job = _stage_job(path, pipeline, index, entry)
        stage = Stage(
            index, entry, job, "", out / "students" / entry.name if entry.kind in MAKES_STUDENT else None, student.student if student else None
        )
        _check_stage(path, stage, student)
        if stage.previous_student and entry.kind in MAKES_STUDENT:
            stage.job = stage.job.model_copy(update={"model": stage.job.model.model_copy(update={"init_from": str(stage.previous_student)})})
        stage.identity = hashlib.sha256(json.dumps(stage.job.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
        stages.append(stage)
        student = stage if entry.kind in MAKES_STUDENT else student
    return pipeline, stages


def _read(path: Path) -> PipelineSpec:
    try:
        tree = yaml.safe_load(path.read_text())
    except OSError as err:
        raise UserError(f"{path}: cannot read the pipeline file ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise UserError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(tree, dict):
        raise UserError(f"{path}: a pipeline file is a YAML mapping with `name` and `stages`")
    try:
        return PipelineSpec.model_validate(tree)
    except ValidationError as err:
        raise UserError(f"{path}: {first_error(err)}") from None


def _stage_job(path: Path, pipeline: PipelineSpec, index: int, entry: StageSpec) -> JobSpec:
    """The stage's job, named and placed by the pipeline, its tracking the pipeline's."""
    tracking = pipeline.tracking.model_dump()
    given = [
        f"name={pipeline.name}-{entry.name}",
        f"output_dir={pipeline.output_dir}",
        *(f"tracking.{key}={json.dumps(value)}" for key, value in tracking.items()),
    ]
    try:
        return load_spec(path.parent / entry.job, [*entry.set, *given]).with_absolute_paths()
    except UserError as err:
        raise UserError(f"{path}: stages[{index}] ({entry.name}): {err}") from None


def _check_stage(path: Path, stage: Stage, previous: Optional[Stage]) -> None:
    kind, job = stage.entry.kind, stage.job
    instruct = job.distill.instruct if job.distill else None

    def refuse(message: str):
        raise UserError(f"{path}: {stage.label}: {message}")

    if kind == "instruct" and instruct is None:
        refuse(f"kind instruct: its job ({stage.entry.job}) has no distill.instruct section (prompts, generate, select)")
    if kind == "train" and instruct is not None:
        refuse(f"its job ({stage.entry.job}) is an instruction distillation; give the stage kind: instruct")
    if kind == "evaluate":
        if previous is None:
            refuse("kind evaluate: judges the previous stage's student, and no stage before it trains one")
        if instruct is None:
            refuse(f"kind evaluate: its job ({stage.entry.job}) names no held-out prompts (distill.instruct with eval_fraction > 0)")
        return
    if previous is not None and job.model.init_from:
        refuse("model.init_from: a stage starts from the previous stage's student; remove it from the job or its overrides")
    if previous is not None:
        differ = [f.name for f in dataclasses.fields(job.model_arch) if getattr(job.model_arch, f.name) != getattr(previous.job.model_arch, f.name)]
        if differ:
            refuse(
                f"its student is not the previous stage's ({previous.entry.name}): model differs in "
                + ", ".join(f"{name} ({getattr(job.model_arch, name)} vs {getattr(previous.job.model_arch, name)})" for name in differ)
            )


class PipelineState:
    """`pipeline.json`: the pipeline's MLflow run and each finished stage's result."""

    def __init__(self, directory: Path, source: Path, stages: list[Stage]):
        self.path = directory / STATE
        self.data = json.loads(self.path.read_text()) if self.path.is_file() else {"stages": {}}
        for stage in stages:
            done = self.data["stages"].get(stage.entry.name)
            if done and done["identity"] != stage.identity:
                raise UserError(
                    f"{source}: {stage.label} changed since it finished ({self.path}); a stage is run once per pipeline: "
                    f"give the pipeline another name, or remove {directory} to run it all again"
                )

    def done(self, stage: Stage) -> Optional[dict]:
        return self.data["stages"].get(stage.entry.name)

    def finish(self, stage: Stage, result: dict) -> None:
        self.data["stages"][stage.entry.name] = {"identity": stage.identity, "kind": stage.entry.kind, **result}
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.data, indent=2))
        os.replace(partial, self.path)


@dataclass(frozen=True)
class StageCalls:
    """The SDK calls a stage makes: the pipeline sits under the SDK, which hands them in."""

    train: Callable[..., RunSummary]
    build_cache: Callable[..., object]
    generate_answers: Callable[..., object]


def run_pipeline(
    path: str | os.PathLike, calls: StageCalls, address: Optional[str] = None, show_progress: bool = True, console: Optional[Console] = None
) -> dict:
    """Run the pipeline's stages that have not finished; returns each stage's result and
    the pipeline's MLflow run."""
    import ray

    from lmforge.ray_runtime import connect
    from lmforge.tracking.pipeline_run import PipelineRun

    console = console or text_console()
    pipeline, stages = load_pipeline(path)
    directory = Path(pipeline.output_dir).absolute() / pipeline.name
    state = PipelineState(directory, Path(path), stages)
    started = any(not state.done(stage) for stage in stages) and connect(address)  # nothing left to run: no Ray
    tracker = PipelineRun(pipeline, stages[0].job, state.data.get("mlflow_run_id"), Path(path)) if pipeline.tracking.enabled else None
    if tracker:
        state.data["mlflow_run_id"] = tracker.run_id
        state.save()
    status = "FAILED"
    try:
        for stage in stages:
            done = state.done(stage)
            if done:
                console.print(
                    plain(
                        f"stage {stage.index + 1}/{len(stages)} {stage.entry.name}: finished before"
                        + (f"; its student: {done['student']}" if done.get("student") else "")
                    ),
                    highlight=False,
                    soft_wrap=True,
                )
                continue
            console.print(
                plain(f"stage {stage.index + 1}/{len(stages)} {stage.entry.name} ({stage.entry.kind}): {stage.entry.job}"),
                highlight=False,
                soft_wrap=True,
            )
            job = stage.job.with_changes("tracking", parent_run_id=tracker.run_id) if tracker else stage.job
            result = RUNNERS[stage.entry.kind](stage, job, calls, show_progress, console, tracker)
            state.finish(stage, result)
            if tracker:
                tracker.log_stage(stage, result)
        status = "FINISHED"
    finally:
        if tracker:
            tracker.finish(status)
        if started:
            ray.shutdown()
    return {
        "pipeline": pipeline.name,
        "directory": str(directory),
        "stages": {s.entry.name: state.done(s) for s in stages},
        "mlflow_run_id": tracker.run_id if tracker else None,
        "mlflow_tracking_uri": redact_uri(stages[0].job.tracking_uri) if tracker else None,
    }


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
    from lmforge.checkpoint.export import export_model

    if stage.student.exists():  # an export an interruption left unfinished
        shutil.rmtree(stage.student)
    stage.student.parent.mkdir(parents=True, exist_ok=True)
    if summary.latest_checkpoint is None:
        raise UserError(f"{stage.label}: its training wrote no checkpoint to export as the next stage's student")
    export_model(summary.latest_checkpoint, str(stage.student))
    return {"student": str(stage.student), "summary": summary.model_dump(mode="json", include=STAGE_SUMMARY, exclude_none=True)}


def _evaluate(stage: Stage, job: JobSpec, calls: StageCalls, show_progress: bool, console: Console, tracker) -> dict:
    from lmforge.distill.instruct.evaluate import ANSWERS_FILE, evaluate_student

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


RUNNERS = {"train": _train, "instruct": _instruct, "evaluate": _evaluate}
