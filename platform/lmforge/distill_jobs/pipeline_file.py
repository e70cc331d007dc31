"""A distillation pipeline file (`lmforge distill run PIPELINE.yaml`): its stages, each
a job file with overrides, read and checked before anything runs, so a bad stage is
one line naming it. `distill.stages` runs them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lmforge.errors import UserError, first_error
from lmforge.spec import JobSpec, TrackingSpec, load_spec

NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
MAKES_STUDENT = ("train", "instruct")


class HarnessStageSpec(BaseModel):
    """A harness stage's lm-evaluation-harness settings (`lmforge eval harness`'s)."""

    model_config = ConfigDict(extra="forbid")

    tasks: list[str] = Field(..., min_length=1, description="lm-eval task names")
    include_path: Optional[str] = Field(None, description="a directory of task YAML files, relative to the pipeline file")
    num_fewshot: Optional[int] = Field(None, ge=0)
    limit: Optional[float] = Field(None, gt=0)
    batch_size: int = Field(8, ge=1)


class StageSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=NAME)
    kind: Literal["train", "instruct", "evaluate", "harness"] = Field(
        ...,
        description="train: train the job (building its teacher cache first if it names one); instruct: its teachers' "
        "answers (unless its dataset exists), then train on them; evaluate: the previous student on the job's held-out prompts; "
        "harness: the previous student on lm-evaluation-harness tasks, on the job's parallel.tp x parallel.pp",
    )
    job: str = Field(..., description="a job file, relative to the pipeline file")
    set: list[str] = Field(default_factory=list, description="overrides of the job's fields, KEY=VALUE")
    harness: Optional[HarnessStageSpec] = Field(None, description="kind harness: its tasks")

    @model_validator(mode="after")
    def _harness_with_its_kind(self) -> "StageSpec":
        if (self.kind == "harness") != (self.harness is not None):
            raise ValueError("harness: a stage of kind harness names its tasks under harness (and only such a stage)")
        return self


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
        if entry.harness and entry.harness.include_path:  # relative to the pipeline file, as its jobs are
            found = str((path.parent / entry.harness.include_path).absolute())
            stage.entry = entry.model_copy(update={"harness": entry.harness.model_copy(update={"include_path": found})})
        if stage.previous_student and entry.kind in MAKES_STUDENT:
            stage.job = stage.job.model_copy(update={"model": stage.job.model.model_copy(update={"init_from": str(stage.previous_student)})})
        ran = stage.job.model_dump(mode="json") | ({"harness": stage.entry.harness.model_dump()} if stage.entry.harness else {})
        stage.identity = hashlib.sha256(json.dumps(ran, sort_keys=True).encode()).hexdigest()
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
    if kind == "harness":
        if previous is None:
            refuse("kind harness: evaluates the previous stage's student, and no stage before it trains one")
        include = stage.entry.harness.include_path if stage.entry.harness else None
        if include and not (path.parent / include).is_dir():
            refuse(f"harness.include_path: {include} is not a directory (beside the pipeline file)")
        return
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
