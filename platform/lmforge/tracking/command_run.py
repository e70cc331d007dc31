"""The MLflow run of a one-shot command (`lmforge quantize`, `lmforge eval judge`): its
settings as params, its numbers as metrics, its report files as artifacts, finished
in one go. The store defaults to the training runs' (`runs/mlflow.db`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from lmforge.tracking.mlflow_run import ROLE_TAG, experiment_id
from lmforge.tracking.store import mlflow_client

DEFAULT_TRACKING_URI = "sqlite:///runs/mlflow.db"


def tracking_uri(given: str | None) -> str:
    uri = given or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        path = Path(uri.removeprefix("sqlite:///")).absolute()
        path.parent.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{path}"
    return uri


def log_command_run(uri: str, experiment: str, name: str, role: str, params: dict, metrics: dict, artifacts: list[Path]) -> str:
    """The run's id."""
    from mlflow.entities import Metric, Param

    client = mlflow_client(uri)
    run = client.create_run(experiment_id(client, experiment, uri), run_name=name, tags={ROLE_TAG: role})
    stamp = int(time.time() * 1000)
    client.log_batch(
        run.info.run_id,
        metrics=[Metric(k, float(v), stamp, 0) for k, v in metrics.items()],
        params=[Param(k, str(v)[:6000]) for k, v in params.items()],
    )
    for path in artifacts:
        client.log_artifact(run.info.run_id, str(path))
    client.set_terminated(run.info.run_id)
    return run.info.run_id
