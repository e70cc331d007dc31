"""An exported model in MLflow: its files as an artifact of the training run that made
the checkpoint, and a new version of the registered model named after the job (a
distilled student is registered under its own job's name, its teacher in a tag)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from lmforge.checkpoint.export import RegisteredModel
from lmforge.tracking.store import mlflow_client

ARTIFACT_PATH = "model"


def register_export(record: dict, out: str | Path, fmt: str, step: Optional[int]) -> Optional[RegisteredModel]:
    """Log and register an export of a checkpoint whose state names its run (`record`
    is the checkpoint's: job, mlflow); None when it names none (tracking was off, or
    the source was not a checkpoint)."""
    tracking = record.get("mlflow")
    if not tracking or not tracking.get("run_id"):
        return None
    from mlflow.exceptions import MlflowException

    client = mlflow_client(tracking["tracking_uri"], registry=True)
    run_id, name = tracking["run_id"], record["job"]
    client.log_artifacts(run_id, str(out), ARTIFACT_PATH)
    try:
        client.create_registered_model(name, tags={"lmforge.job": name}, description=f"lmforge job {name}: models exported from its checkpoints")
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    params = client.get_run(run_id).data.params
    teacher = next((params[key] for key in ("distill.teacher", "distill.teachers") if params.get(key, "None") != "None"), None)
    tags = {"lmforge.step": str(step), "lmforge.format": fmt} | ({"lmforge.teacher": teacher} if teacher else {})
    version = client.create_model_version(name, source=f"runs:/{run_id}/{ARTIFACT_PATH}", run_id=run_id, tags=tags)
    return RegisteredModel(name=name, version=int(version.version), run_id=run_id)
