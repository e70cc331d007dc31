"""A distillation pipeline's MLflow run: its stages' runs nest under it (each stage's
job sets `tracking.parent_run_id` to it), it holds the pipeline file, each stage's
headline numbers, and an evaluate stage's own child run. A rerun reopens it.
"""

from __future__ import annotations

import json
from pathlib import Path

from lmforge.tracking.mlflow_run import JOB_TAG, PARENT_TAG, ROLE_TAG, experiment_id, log_answers
from lmforge.tracking.store import mlflow_client

STAGE_METRICS = ("final_loss", "eval_loss", "eval_kl", "eval_top1")


class PipelineRun:
    def __init__(self, pipeline, first_job, run_id: str | None, source: Path):
        self.client = mlflow_client(first_job.tracking_uri)
        self.exp_id = experiment_id(self.client, first_job.tracking.experiment, first_job.tracking_uri)
        self.key = f"pipeline:{Path(pipeline.output_dir).absolute() / pipeline.name}"
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return
        run = self.client.create_run(self.exp_id, run_name=pipeline.name, tags={JOB_TAG: self.key, ROLE_TAG: "pipeline"})
        self.run_id = run.info.run_id
        self.client.log_artifact(self.run_id, str(source))

    def log_stage(self, stage, numbers: dict, record: dict) -> None:
        """A finished stage's headline numbers, as `<stage>.<metric>` at its index, and
        its record (what pipeline.json keeps of it but the summary) as a tag."""
        from mlflow.entities import Metric

        harness = [key for key in numbers if key.startswith("harness/")]  # a harness stage's lm-eval metrics
        metrics = [
            Metric(f"{stage.entry.name}.{key}", float(numbers[key]), 0, stage.index)
            for key in (*STAGE_METRICS, "answers_nll", *harness)
            if numbers.get(key) is not None
        ]
        self.client.log_batch(self.run_id, metrics=metrics)
        self.client.set_tag(self.run_id, f"lmforge.stage.{stage.entry.name}", json.dumps(record)[:5000])

    def log_evaluation(self, stage, answered: dict) -> str:
        """An evaluate stage's run: the student's held-out metrics and its answers' table."""
        run = self.client.create_run(
            self.exp_id,
            run_name=f"{stage.job.name} evaluation",
            tags={JOB_TAG: self.key, ROLE_TAG: "evaluation", PARENT_TAG: self.run_id, "lmforge.stage": stage.entry.name},
        )
        log_answers(self.client, run.info.run_id, answered, stage.index)
        self.client.set_terminated(run.info.run_id, status="FINISHED")
        return run.info.run_id

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)
