"""Submission and listing over Ray's `JobSubmissionClient`, with Ray's connection,
authentication and lookup failures turned into lmforge's one-line errors."""

from __future__ import annotations

import json
import os
import uuid
from contextlib import contextmanager
from typing import Optional, Union

from lmforge.credentials import redact_uri, secret_fields
from lmforge.errors import UserError, first_line
from lmforge.spec import JobSpec, load_spec

SPEC_ENV = "LMFORGE_JOB_SPEC"  # the validated job, as JSON, in the submitted job's environment
ENTRYPOINT = "lmforge train --submitted"
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class ClusterUnreachable(UserError):
    """Nothing answers at the address, or it is not a Ray job API."""


class AuthenticationFailed(UserError):
    """The cluster wants a token this client did not send, or sent wrong."""


class UnknownJob(UserError):
    """No job with that id on the cluster."""


def address_of(address: Optional[str]) -> str:
    return address or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS


@contextmanager
def translated(address: str, job_id: Optional[str] = None):
    """Ray's exceptions for an unreachable cluster, a refused token or an unknown job,
    as lmforge's (each a `UserError`: one line, exit 2 on the CLI)."""
    from ray.exceptions import AuthenticationError

    try:
        yield
    except AuthenticationError:
        raise AuthenticationFailed(
            f"{address}: the cluster refused this client's auth token (set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH to the "
            "cluster's token, or pass token=)"
        ) from None
    except ConnectionError as err:
        raise ClusterUnreachable(f"{address}: no Ray job API answers there ({first_line(err)})") from None
    except RuntimeError as err:
        if job_id is not None and "404" in str(err):
            raise UnknownJob(f"{address}: no job {job_id!r} on this cluster (`lmforge jobs` lists them)") from None
        raise


def connect(address: Optional[str] = None, token: Optional[str] = None):
    """A `JobSubmissionClient` for `address` (default: RAY_ADDRESS, else the local
    dashboard). `token`: the cluster's auth token, if not in Ray's environment variables."""
    from ray.job_submission import JobSubmissionClient

    address = address_of(address)
    token = token or cluster_token()
    headers = {"Authorization": f"Bearer {token}"} if token else None
    with translated(address):
        return JobSubmissionClient(address, headers=headers)


def cluster_token() -> Optional[str]:
    """Ray's own settings for the token (RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH
    names), whether or not RAY_AUTH_MODE is set in this process."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        try:
            return open(path).read().strip()
        except OSError as err:
            raise UserError(f"RAY_AUTH_TOKEN_PATH: cannot read {path} ({err.strerror})") from None
    return None


def submit(job: Union[str, os.PathLike, JobSpec], overrides: list[str] = (), address: Optional[str] = None,
           working_dir: Optional[str] = None, runtime_env: Optional[dict] = None, token: Optional[str] = None,
           name_suffix: Optional[str] = None):
    """Submit a job file (or a loaded `JobSpec`) to run on a cluster; returns its
    `JobHandle` at once. The job is validated here first, so a bad field fails in the
    caller with the same one-line error as `lmforge train`, and nothing is submitted.
    `working_dir` is uploaded and becomes the job's working directory (relative paths
    in the job resolve there); `runtime_env` is Ray's, merged under lmforge's own."""
    from lmforge.jobs.handle import JobHandle

    spec = job if isinstance(job, JobSpec) else load_spec(job, list(overrides))
    if overrides and isinstance(job, JobSpec):
        raise UserError("submit: overrides go with a job file; apply them to a JobSpec with sdk.load(path, overrides)")
    carried = secret_fields(spec.model_dump(mode="json", exclude_unset=True))
    if carried:
        raise UserError(f"{carried[0]}: holds a credential, and a submitted job's environment is readable by anyone who can list the "
                        "cluster's jobs; give it to the cluster's nodes instead (MLflow: MLFLOW_TRACKING_USERNAME and "
                        "MLFLOW_TRACKING_PASSWORD; Comet: COMET_API_KEY) and drop it from the job")
    env = dict(runtime_env or {})
    if working_dir is not None:
        if not os.path.isdir(working_dir):
            raise UserError(f"working_dir: {working_dir} is not a directory")
        env["working_dir"] = os.fspath(working_dir)
    env["env_vars"] = {**env.get("env_vars", {}), SPEC_ENV: json.dumps(spec.model_dump(mode="json", exclude_unset=True)),
                       "OMP_NUM_THREADS": env.get("env_vars", {}).get("OMP_NUM_THREADS", "1")}
    client = connect(address, token)
    with translated(client.get_address()):
        running = [j for j in _lmforge_jobs(client) if j.metadata.get("lmforge_job") == spec.name and j.status not in TERMINAL]
        if running:
            raise UserError(f"job {spec.name} is already running on this cluster as {running[0].submission_id}; "
                            f"stop it first (lmforge stop {running[0].submission_id})")
        submission_id = f"lmforge-{spec.name}-{name_suffix or uuid.uuid4().hex[:8]}"
        client.submit_job(entrypoint=ENTRYPOINT, submission_id=submission_id, runtime_env=env,
                          metadata={"lmforge_job": spec.name, "lmforge_output_dir": spec.output_dir})
    return JobHandle(submission_id, client)


def job(job_id: str, address: Optional[str] = None, token: Optional[str] = None):
    """The `JobHandle` of a job submitted earlier (from `jobs()`, or what `submit`
    printed): a notebook reopened later finds its job again."""
    from lmforge.jobs.handle import JobHandle

    return JobHandle(job_id, connect(address, token))


def jobs(address: Optional[str] = None, token: Optional[str] = None):
    """The cluster's lmforge jobs, newest first, as a pandas DataFrame: id, job,
    status, start and end times, message."""
    import pandas as pd

    client = connect(address, token)
    with translated(client.get_address()):
        rows = [{"id": j.submission_id, "job": j.metadata.get("lmforge_job"), "status": str(j.status.value if hasattr(j.status, "value") else j.status),
                 "start": _time(j.start_time), "end": _time(j.end_time), "message": j.message}
                for j in _lmforge_jobs(client)]
    frame = pd.DataFrame(rows, columns=["id", "job", "status", "start", "end", "message"])
    return frame.sort_values("start", ascending=False, ignore_index=True) if len(frame) else frame


def runs(experiment: str = "lmforge", tracking_uri: Optional[str] = None):
    """An MLflow experiment's runs as a pandas DataFrame (MLflow's `search_runs`):
    one row per run with its params, latest metrics and tags."""
    import mlflow

    from lmforge.tracking.command_run import DEFAULT_TRACKING_URI

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    if uri.startswith("sqlite:///") and not os.path.exists(uri.removeprefix("sqlite:///")):
        raise UserError(f"tracking_uri: {redact_uri(uri)} does not exist (a job's store is sqlite:///<output_dir>/mlflow.db unless tracking.uri says otherwise)")
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
    from lmforge.spec import spec_from_dict

    text = os.environ.get(SPEC_ENV)
    if not text:
        raise UserError(f"train --submitted: {SPEC_ENV} is not set (this flag is for jobs that `lmforge submit` started)")
    return spec_from_dict(json.loads(text), list(overrides))
