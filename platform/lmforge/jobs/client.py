"""Submission and listing over Ray's `JobSubmissionClient` (connected and its
failures translated by `connection.py`)."""

from __future__ import annotations

import json
import os
import uuid
from typing import Optional, Union

from lmforge.credentials import redact_uri, secret_fields
from lmforge.errors import UserError
from lmforge.jobs.connection import TERMINAL, connect, translated
from lmforge.jobs.handle import JobHandle
from lmforge.spec import JobSpec, load_spec, spec_from_dict
from lmforge.tracking.command_run import DEFAULT_TRACKING_URI

SPEC_ENV = "LMFORGE_JOB_SPEC"  # the validated job, as JSON, in the submitted job's environment
ENTRYPOINT = "lmforge train --submitted"


def submit(
    job: Union[str, os.PathLike, JobSpec],
    overrides: list[str] = (),
    address: Optional[str] = None,
    working_dir: Optional[str] = None,
    runtime_env: Optional[dict] = None,
    token: Optional[str] = None,
    name_suffix: Optional[str] = None,
):
    """Submit a job file (or a loaded `JobSpec`) to run on a cluster; returns its
    `JobHandle` at once. The job is validated here first, so a bad field fails in the
    caller with the same one-line error as `lmforge train`, and nothing is submitted.
    `working_dir` is uploaded and becomes the job's working directory (relative paths
    in the job resolve there); `runtime_env` is Ray's, merged under lmforge's own."""
    spec = job if isinstance(job, JobSpec) else load_spec(job, list(overrides))
    if overrides and isinstance(job, JobSpec):
        raise UserError("submit: overrides go with a job file; apply them to a JobSpec with sdk.load(path, overrides)")
    carried = secret_fields(spec.model_dump(mode="json", exclude_unset=True))
    if carried:
        raise UserError(
            f"{carried[0]}: holds a credential, and a submitted job's environment is readable by anyone who can list the "
            "cluster's jobs; give it to the cluster's nodes instead (MLflow: MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD; Comet: COMET_API_KEY) and drop it from the job"
        )
    env = dict(runtime_env or {})
    if working_dir is not None:
        if not os.path.isdir(working_dir):
            raise UserError(f"working_dir: {working_dir} is not a directory")
        env["working_dir"] = os.fspath(working_dir)
    env["env_vars"] = {
        **env.get("env_vars", {}),
        SPEC_ENV: json.dumps(spec.model_dump(mode="json", exclude_unset=True)),
        "OMP_NUM_THREADS": env.get("env_vars", {}).get("OMP_NUM_THREADS", "1"),
    }
    client = connect(address, token)
    with translated(client.get_address()):
        running = [j for j in _lmforge_jobs(client) if j.metadata.get("lmforge_job") == spec.name and j.status not in TERMINAL]
        if running:
            raise UserError(
                f"job {spec.name} is already running on this cluster as {running[0].submission_id}; "
                f"stop it first (lmforge stop {running[0].submission_id})"
            )
        submission_id = f"lmforge-{spec.name}-{name_suffix or uuid.uuid4().hex[:8]}"
        client.submit_job(
            entrypoint=ENTRYPOINT,
            submission_id=submission_id,
            runtime_env=env,
            metadata={"lmforge_job": spec.name, "lmforge_output_dir": spec.output_dir},
        )
    return JobHandle(submission_id, client)


def job(job_id: str, address: Optional[str] = None, token: Optional[str] = None):
    """The `JobHandle` of a job submitted earlier (from `jobs()`, or what `submit`
    printed): a notebook reopened later finds its job again."""
    return JobHandle(job_id, connect(address, token))


def jobs(address: Optional[str] = None, token: Optional[str] = None):
    """The cluster's lmforge jobs, newest first, as a pandas DataFrame: id, job,
    status, start and end times, message."""
    import pandas as pd

    client = connect(address, token)
    with translated(client.get_address()):
        rows = [
            {
                "id": j.submission_id,
                "job": j.metadata.get("lmforge_job"),
                "status": str(j.status.value if hasattr(j.status, "value") else j.status),
                "start": _time(j.start_time),
                "end": _time(j.end_time),
                "message": j.message,
            }
            for j in _lmforge_jobs(client)
        ]
    frame = pd.DataFrame(rows, columns=["id", "job", "status", "start", "end", "message"])
    return frame.sort_values("start", ascending=False, ignore_index=True) if len(frame) else frame


def runs(experiment: str = "lmforge", tracking_uri: Optional[str] = None):
    """An MLflow experiment's runs as a pandas DataFrame (MLflow's `search_runs`):
    one row per run with its params, latest metrics and tags."""
    import mlflow

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    if uri.startswith("sqlite:///") and not os.path.exists(uri.removeprefix("sqlite:///")):
        raise UserError(
            f"tracking_uri: {redact_uri(uri)} does not exist (a job's store is sqlite:///<output_dir>/mlflow.db unless tracking.uri says otherwise)"
        )
    found = mlflow.MlflowClient(uri).get_experiment_by_name(experiment)
    if found is None:
        raise UserError(f"experiment: no MLflow experiment {experiment!r} in {redact_uri(uri)}")
    mlflow.set_tracking_uri(uri)
    return mlflow.search_runs(experiment_ids=[found.experiment_id], order_by=["attributes.start_time DESC"])


def _lmforge_jobs(client) -> list:
    return [j for j in client.list_jobs() if (j.metadata or {}).get("lmforge_job")]


def _time(ms: Optional[int]):
    import pandas as pd

    return pd.Timestamp(ms, unit="ms") if ms else None


def submitted_spec(overrides: list[str] = ()) -> JobSpec:
    """On the cluster: the job `submit` validated, from the job's environment."""
    text = os.environ.get(SPEC_ENV)
    if not text:
        raise UserError(f"train --submitted: {SPEC_ENV} is not set (this flag is for jobs that `lmforge submit` started)")
    return spec_from_dict(json.loads(text), list(overrides))
