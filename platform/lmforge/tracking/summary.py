"""What a finished training job returns, as one typed record: `sdk.train`, the run
directory's summary.json, `lmforge train --json`, a submitted job's last event line
(`JobHandle.summary`) and a pipeline's stages all carry this."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict


class RunSummary(BaseModel):
    # Written by one lmforge and read by another (a submitted job's client): a field
    # added later is ignored, not refused.
    model_config = ConfigDict(extra="ignore")

    job: str
    final_step: int
    final_loss: Optional[float]  # None: the job was already at train.max_steps
    eval_loss: Optional[float]
    eval_ppl: Optional[float]
    eval_step: Optional[int]
    start_step: int
    tokens: int
    wall_seconds: float
    first_step_data_wait_seconds: float
    data_wait_fraction: Optional[float]
    world_size: int
    dp: int
    data_bytes_read: Optional[int]  # by the job's readers that lasted to its end
    failures: int
    ranks: list[dict[str, Any]]
    run_dir: str
    latest_checkpoint: Optional[str]
    mlflow_tracking_uri: Optional[str]
    mlflow_run_id: Optional[str]
    # Only some jobs have these; absent from the JSON when they do not.
    eval_kl: Optional[float] = None  # a distillation's held-out KL and top-1 agreement
    eval_top1: Optional[float] = None
    mlflow_parent_run_id: Optional[str] = None  # the distillation job's run this one nests under
    student_answers: Optional[dict[str, Any]] = None  # an instruction distillation's student on its held-out prompts

    def as_json(self) -> dict[str, Any]:
        """The JSON form: summary.json, `--json`, the event stream."""
        return self.model_dump(mode="json", exclude_defaults=True)
