"""One MLflow run per job: the flattened spec as params, per-step metrics, the spec
as an artifact. A resumed job (same name and checkpoint dir) continues its run.

A distillation job is a parent run with child runs: the teacher cache's build (or the
teachers' answers), the training, and the final evaluation of the trained student. A
stage of a distillation pipeline nests under the pipeline's run (`tracking.parent_run_id`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
import warnings
from functools import cached_property
from typing import Callable

import yaml

from lmforge.credentials import redact
from lmforge.data.manifest import Manifest, MixtureManifest
from lmforge.events import Eval, step_metrics
from lmforge.spec import JobSpec, flatten
from lmforge.tracking.store import mlflow_client

JOB_TAG = "lmforge.job"
ROLE_TAG = "lmforge.role"  # "train", "cache", "generate" and "evaluation"; "job" for a distillation's parent; "pipeline"
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: its UI nests a run under that one
ANSWERS_TABLE = "student_answers.json"  # a student's answers to held-out prompts: MLflow's table artifact, which its UI shows

for _noisy in ("alembic", "mlflow"):
    logging.getLogger(_noisy).setLevel(logging.WARNING)


def artifact_root(tracking_uri: str) -> str | None:
    """Beside a local SQLite store (`<its folder>/mlartifacts`); MLflow's own default
    is `./mlruns` under whatever directory the driver happens to run in."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return os.path.join(os.path.dirname(os.path.abspath(tracking_uri.removeprefix("sqlite:///"))), "mlartifacts")


def experiment_id(client, name: str, tracking_uri: str) -> str:
    exp = client.get_experiment_by_name(name)
    return exp.experiment_id if exp else client.create_experiment(name, artifact_location=artifact_root(tracking_uri))


def job_key(spec: JobSpec) -> str:
    """Identity of a job across resubmissions: its name and where its checkpoints live."""
    where = spec.checkpoint_dir if "://" in spec.checkpoint_dir else os.path.abspath(spec.checkpoint_dir)
    return hashlib.sha256(f"{spec.name}\n{where}".encode()).hexdigest()[:16]


class MlflowRun:
    """The run of one part of a job (`role`: its training, or a distillation's cache
    build), under the job's parent run when it is a distillation."""

    def __init__(self, spec: JobSpec, flush_every_s: float = 2.0, role: str = "train", more_params: Callable[[], dict[str, str]] = dict):
        """`more_params`: what the job's params leave out (a distillation's teachers' weight
        hashes, its cache's identity), computed only when a new run logs its params."""
        self.spec, self.flush_every_s, self.role, self.more_params = spec, flush_every_s, role, more_params
        self.client = mlflow_client(spec.tracking_uri)
        self._pending: list = []
        self._last_flush = time.time()
        self.exp_id = experiment_id(self.client, spec.tracking.experiment, spec.tracking_uri)
        self.key = job_key(spec)
        self.parent_id: str | None = None
        self.run_id, self.resumed = self._open_run()

    def _latest(self, role: str, parent_id: str | None = None):
        query = f"tags.`{JOB_TAG}` = '{self.key}' and tags.`{ROLE_TAG}` = '{role}'"
        if parent_id:
            query += f" and tags.`{PARENT_TAG}` = '{parent_id}'"
        found = self.client.search_runs([self.exp_id], filter_string=query, max_results=1, order_by=["attributes.start_time DESC"])
        return found[0] if found else None

    def _open_run(self) -> tuple[str, bool]:
        if self.role == "train" and self.spec.checkpoint.resume:
            found = self._latest("train")
            if found:
                run_id, self.parent_id = found.info.run_id, found.data.tags.get(PARENT_TAG)
                for run in (run_id, self.parent_id):
                    if run:
                        self.client.update_run(run, status="RUNNING")
                return run_id, True
        if self.spec.distill:
            self.parent_id = self._job_run()
        return self._child(self.role), False

    def _job_run(self) -> str:
        """A distillation's parent run: the latest one whose training has not begun (a
        cache build made it), else a new one."""
        parent = self._latest("job")
        if parent is not None and self._latest("train", parent.info.run_id) is None:
            self.client.update_run(parent.info.run_id, status="RUNNING")
            return parent.info.run_id
        run = self.client.create_run(self.exp_id, run_name=self.spec.name, tags={JOB_TAG: self.key, ROLE_TAG: "job", **self._outer_tag})
        self._log_spec(run.info.run_id)
        return run.info.run_id

    def _child(self, role: str) -> str:
        tags = {JOB_TAG: self.key, ROLE_TAG: role, "lmforge.engine": self.spec.engine}
        tags |= {PARENT_TAG: self.parent_id} if self.parent_id else self._outer_tag
        name = f"{self.spec.name} {role}" if self.parent_id else self.spec.name
        run = self.client.create_run(self.exp_id, run_name=name, tags=tags)
        self._log_spec(run.info.run_id)
        return run.info.run_id

    @property
    def _outer_tag(self) -> dict:
        """The job's top run nests under the run it is part of (a pipeline's), if any."""
        outer = self.spec.tracking.parent_run_id
        return {PARENT_TAG: outer} if outer else {}

    @cached_property
    def _spec_params(self) -> dict:
        """The job's params, computed once: a distillation's parent and child runs all
        log them, and they include hashes of the teachers' weights (read in full)."""
        return flatten(redact(self.spec.model_dump(mode="json"))) | self.more_params()

    def _log_spec(self, run_id: str) -> None:
        self._log_params(run_id, self._spec_params)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "job.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(redact(self.spec.model_dump(mode="json")), f, sort_keys=False)
            self.client.log_artifact(run_id, path)

    def log_dataset(self, manifest: Manifest) -> None:
        """The prepared dataset as the run's training input: its path, and as digest the
        identity that decides the data order (tokenizer, samples, shard contents), so
        two runs on the same data show the same dataset. Once per run."""
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput, InputTag

        if self.resumed:
            return
        # A mixture: each source is an input of its own, its weight as a tag.
        parts = (
            [(s.path, s.manifest, s.weight) for s in manifest.sources]
            if isinstance(manifest, MixtureManifest)
            else [(self.spec.data.path, manifest, None)]
        )
        inputs, digests = [], []
        for path, part, weight in parts:
            digest = hashlib.sha256(
                "\n".join([part.tokenizer.sha256, str(part.num_samples)] + [shard.sha256 or "" for shard in part.shards]).encode()
            ).hexdigest()[:16]
            dataset = MetaDataset(_dataset_source(path), name=os.path.basename(path.rstrip("/")), digest=digest)
            tags = [InputTag("mlflow.data.context", "train")] + ([InputTag("lmforge.mixture.weight", str(weight))] if weight is not None else [])
            inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags=tags))
            digests.append(digest)
        self.client.log_inputs(self.run_id, datasets=inputs)
        self._log_params(
            self.run_id,
            {"data.num_samples": manifest.num_samples, "data.num_tokens": manifest.num_tokens, "data.digest": ",".join(digests)},
        )

    def log_step(self, row: dict) -> None:
        """A step's metrics.jsonl row."""
        from mlflow.entities import Metric

        stamp = int(row.get("time", time.time()) * 1000)
        self._pending += [Metric(key, value, stamp, row["step"]) for key, value in step_metrics(row).items()]
        if time.time() - self._last_flush >= self.flush_every_s:
            self.flush()

    def catch_up(self, steps: list[dict]) -> int:
        """On resume, log the steps that `metrics.jsonl` has and this run lacks (a driver
        killed between two flushes lost them). Returns how many were added."""
        if not self.resumed:
            return 0
        have = {m.step for m in self.client.get_metric_history(self.run_id, "loss")}
        missing = [row for row in steps if row["step"] not in have]
        for row in missing:
            self.log_step(row)
        self.flush()
        return len(missing)

    def log_metric(self, key: str, value: float, step: int) -> None:
        from mlflow.entities import Metric

        self._pending.append(Metric(key, float(value), int(time.time() * 1000), step))

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def log_artifact(self, path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def flush(self) -> None:
        for i in range(0, len(self._pending), 1000):
            self.client.log_batch(self.run_id, metrics=self._pending[i : i + 1000])
        self._pending, self._last_flush = [], time.time()

    def log_params(self, values: dict) -> None:
        self._log_params(self.run_id, values)

    def _log_params(self, run_id: str, values: dict) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in sorted(values.items())]
        for i in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[i : i + 100])

    def finish(self, status: str) -> None:
        """This run ends; so does, for now, the job's parent (a later part reopens it)."""
        self.flush()
        self.client.set_terminated(self.run_id, status=status)
        if self.parent_id:
            self.client.set_terminated(self.parent_id, status=status)

    def log_evaluation(self, evaluation: Eval, summary_path, answered: dict | None = None) -> str | None:
        """A distillation's final evaluation as its own child run: the trained student's
        held-out metrics at the last step, and the job's summary; an instruction
        distillation's also the student's answers to held-out prompts (`answered`: their
        metrics, and the table beside its teachers' answers). Returns its run id."""
        if not self.parent_id:
            return None
        run_id = self._child("evaluation")
        log_answers(self.client, run_id, answered or {"metrics": {}}, evaluation.step, evaluation.metrics())
        self.client.log_artifact(run_id, str(summary_path))
        self.client.set_terminated(run_id, status="FINISHED")
        self.client.set_terminated(self.parent_id, status="FINISHED")
        return run_id


def _dataset_source(path: str):
    """MLflow's source for a local folder or an object-store URI (s3://, gs://...)."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.http_dataset_source import HTTPDatasetSource

    try:
        with warnings.catch_warnings():  # a local folder matches two of MLflow's sources, the same class twice
            warnings.simplefilter("ignore")
            return resolve_dataset_source(path if "://" in path else os.path.abspath(path))
    except Exception:  # noqa: BLE001 - a scheme MLflow has no source for: keep the URI all the same
        return HTTPDatasetSource(path)


def log_answers(client, run_id: str, answered: dict, step: int, more: dict | None = None) -> None:
    """A student's held-out metrics (`more` beside its answers'), and its answers' table
    (MLflow's table artifact, which its UI shows and a judge reads)."""
    from mlflow.entities import Metric

    stamp = int(time.time() * 1000)
    values = (more or {}) | answered["metrics"]
    client.log_batch(run_id, metrics=[Metric(k, float(v), stamp, step) for k, v in values.items()])
    if answered.get("table"):
        client.log_table(run_id, {column: [row[column] for row in answered["table"]] for column in answered["table"][0]}, ANSWERS_TABLE)
