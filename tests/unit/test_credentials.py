"""Credentials are used, never written down: URIs and job trees redacted in one place,
what MLflow records of a job (params and the job.yaml artifact, in a real store)
holds no secret, DeepSpeed's comet key goes to the environment and not into its
config (which every DeepSpeed checkpoint keeps)."""

import os

import pytest
import yaml

from conftest import tiny_job
from lmforge.credentials import REDACTED, redact, redact_uri, secret_fields, without_credentials
from lmforge.spec import spec_from_dict

SECRET = "s3cr3t-pa55"


@pytest.mark.parametrize(
    "uri, shown",
    [
        (f"http://alice:{SECRET}@mlflow:5000", "http://alice:***@mlflow:5000"),
        (f"http://{SECRET}@mlflow:5000/path", "http://***@mlflow:5000/path"),
        (f"postgresql://mlflow:5432/db?user=alice&password={SECRET}", "postgresql://mlflow:5432/db?user=alice&password=***"),
        (f"https://store/x?sig={SECRET}&token={SECRET}&region=eu", "https://store/x?sig=***&token=***&region=eu"),
        ("sqlite:///runs/mlflow.db", "sqlite:///runs/mlflow.db"),
        ("runs/[/x]/mlflow.db", "runs/[/x]/mlflow.db"),
    ],
)
def test_a_uri_is_shown_without_its_secrets(uri, shown):
    assert redact_uri(uri) == shown
    assert SECRET not in without_credentials(uri) and "***" not in without_credentials(uri)


def test_a_job_tree_is_redacted_by_field_name_and_by_uri():
    tree = {
        "tracking": {"uri": f"http://a:{SECRET}@h"},
        "deepspeed": {"config": {"comet": {"api_key": SECRET, "enabled": True}}},
        "data": {"tokenizer": "tok.json", "max_tokens": 5},
        "auth_token": SECRET,
        "sources": [{"path": f"s3://b/x?password={SECRET}"}],
    }
    shown = redact(tree)
    assert SECRET not in repr(shown)
    assert shown["deepspeed"]["config"]["comet"] == {"api_key": REDACTED, "enabled": True}
    assert shown["data"] == {"tokenizer": "tok.json", "max_tokens": 5}  # named like tokens, not secrets
    assert sorted(secret_fields(tree)) == ["auth_token", "deepspeed.config.comet.api_key", "sources[0].path", "tracking.uri"]


def test_mlflow_records_of_a_job_hold_no_secret(tmp_path):
    """A real MLflow store: the run's params and its job.yaml artifact."""
    from mlflow.tracking import MlflowClient

    from lmforge.tracking.mlflow_run import MlflowRun

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = tiny_job(
        tmp_path,
        tmp_path / "data",
        engine="deepspeed",
        tracking={"uri": store, "experiment": "secrets"},
        deepspeed={"config": {"comet": {"enabled": False, "api_key": SECRET}}},
    )
    run = MlflowRun(spec_from_dict(job))
    run.finish("FINISHED")
    client = MlflowClient(store)
    params = client.get_run(run.run_id).data.params
    assert params["deepspeed.config.comet.api_key"] == REDACTED and SECRET not in repr(params)
    local = client.download_artifacts(run.run_id, "job.yaml", str(tmp_path))
    text = open(local).read()
    assert SECRET not in text and yaml.safe_load(text)["deepspeed"]["config"]["comet"]["api_key"] == REDACTED


def test_deepspeed_gets_its_comet_key_from_the_environment_not_its_config(monkeypatch):
    from lmforge.engines.deepspeed import _credentials_to_environment

    monkeypatch.delenv("COMET_API_KEY", raising=False)
    given = {"comet": {"enabled": True, "api_key": SECRET}, "train_batch_size": 8}
    config = _credentials_to_environment(given)
    assert config == {"comet": {"enabled": True}, "train_batch_size": 8} and os.environ["COMET_API_KEY"] == SECRET
    assert given["comet"]["api_key"] == SECRET  # the job's own config is left as it was
