"""One MLflow run per job: the flattened spec as params, per-step metrics, the spec
as an artifact. A resumed job (same name and checkpoint dir) continues its run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time

import yaml

from lmforge.spec import JobSpec, flatten

JOB_TAG = "lmforge.job"
METRIC_KEYS = ("loss", "ce_loss", "kd_loss", "hidden_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "bubble", "bubble_theory", "step_time", "data_wait")

for _noisy in ("alembic", "mlflow"):
    logging.getLogger(_noisy).setLevel(logging.WARNING)


def artifact_root(tracking_uri: str) -> str | None:
    """Beside a local SQLite store (`<its folder>/mlartifacts`); MLflow's own default
    is `./mlruns` under whatever directory the driver happens to run in."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return os.path.join(os.path.dirname(os.path.abspath(tracking_uri.removeprefix("sqlite:///"))), "mlartifacts")


def job_key(spec: JobSpec) -> str:
    """Identity of a job across resubmissions: its name and where its checkpoints live."""
    where = spec.checkpoint_dir if "://" in spec.checkpoint_dir else os.path.abspath(spec.checkpoint_dir)
    return hashlib.sha256(f"{spec.name}\n{where}".encode()).hexdigest()[:16]


class MlflowRun:
    def __init__(self, spec: JobSpec, flush_every_s: float = 2.0):
        from mlflow.tracking import MlflowClient

        self.spec, self.flush_every_s = spec, flush_every_s
        self.client = MlflowClient(tracking_uri=spec.tracking_uri)
        self._pending: list = []
        self._last_flush = time.time()
        self.run_id, self.resumed = self._open_run()

    def _open_run(self) -> tuple[str, bool]:
        exp = self.client.get_experiment_by_name(self.spec.tracking.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(self.spec.tracking.experiment, artifact_location=artifact_root(self.spec.tracking_uri))
        key = job_key(self.spec)
        if self.spec.checkpoint.resume:
            found = self.client.search_runs([exp_id], filter_string=f"tags.`{JOB_TAG}` = '{key}'", max_results=1, order_by=["attributes.start_time DESC"])
            if found:
                run_id = found[0].info.run_id
                self.client.update_run(run_id, status="RUNNING")
                return run_id, True
        run = self.client.create_run(exp_id, run_name=self.spec.name, tags={JOB_TAG: key, "lmforge.engine": self.spec.engine})
        self._log_spec(run.info.run_id)
        return run.info.run_id, False

    def _log_spec(self, run_id: str) -> None:
        from mlflow.entities import Param

        from lmforge.distill.cache import tracking_params

        values = flatten(self.spec.model_dump(mode="json")) | tracking_params(self.spec)
        params = [Param(k, str(v)[:6000]) for k, v in sorted(values.items())]
        for i in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[i : i + 100])
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "job.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(self.spec.model_dump(mode="json"), f, sort_keys=False)
            self.client.log_artifact(run_id, path)

    def log_step(self, event: dict) -> None:
        from mlflow.entities import Metric

        stamp = int(event.get("time", time.time()) * 1000)
        self._pending += [Metric(k, float(event[k]), stamp, event["step"]) for k in METRIC_KEYS if k in event]
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

    def finish(self, status: str) -> None:
        self.flush()
        self.client.set_terminated(self.run_id, status=status)
