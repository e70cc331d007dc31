"""Jobs on a real head started with `ray start --head` (private ports, temp dir and
auth token; one head for the module): `ray job submit` of the quickstart, its
checkpoint exported for transformers; the notebook (submit, follow, plot, export,
generate) run headless; `lmforge submit | jobs | status | logs | stop` and the
SDK's refusals; a running job's Prometheus metrics scraped from the node."""

import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from cli import assert_clean_error, run_cli
from conftest import REPO
from lmforge.checkpoint.store import CheckpointStore
from lmforge.tracking.summary import RunSummary
from ports import free_port
from ray_head import BIN, ray_head

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    with ray_head(tmp_path_factory.mktemp("head")) as started:
        yield started


def tiny(dataset: Path, out: Path, steps: int = 4) -> list[str]:
    """The quickstart, shrunk to seconds: a tiny model on the tiny dataset."""
    return [
        "model.preset=tiny",
        "model.vocab_size=512",
        "train.seq_len=32",
        "train.global_batch=8",
        "train.micro_batch=2",
        f"train.max_steps={steps}",
        "checkpoint.interval=2",
        "data.prefetch_steps=4",
        f"data.path={dataset}",
        "data.eval_fraction=0.1",
        "eval.interval=2",
        f"output_dir={out}",
    ]


def test_quickstart_through_ray_job_submit(head, tiny_dataset, tmp_path):
    out = tmp_path / "out"
    cmd = [
        str(BIN / "ray"),
        "job",
        "submit",
        "--address",
        head.address,
        "--working-dir",
        ".",
        "--",
        "lmforge",
        "train",
        "jobs/quickstart.yaml",
        "--no-progress",
    ]
    for item in tiny(tiny_dataset, out):
        cmd += ["--set", item]
    result = subprocess.run(cmd, cwd=REPO, env=head.env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "succeeded" in result.stdout + result.stderr
    summary = RunSummary.model_validate_json((out / "quickstart" / "summary.json").read_text())
    assert summary.final_step == 4 and summary.world_size == 2
    assert summary.eval_step == 4 and summary.eval_loss > 0  # the quickstart's held-out loss
    assert (out / "quickstart" / "checkpoints" / "step_00000004" / "commit.json").exists()
    assert "MLflow run" in result.stdout
    check_hf_export(out / "quickstart" / "checkpoints" / "step_00000004", tmp_path)


def check_hf_export(step_dir: Path, tmp_path: Path) -> None:
    """The trained checkpoint as a Hugging Face directory: transformers' logits equal
    lmforge's within 1e-5, its tokenizer gives the dataset tokenizer's ids, and
    greedy generation from the checkpoint itself gives transformers' tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cli import run_cli
    from lmforge import sdk
    from lmforge.checkpoint.consolidate import read_checkpoint
    from lmforge.checkpoint.export import open_source
    from lmforge.models.build import build_model

    result = run_cli("export", str(step_dir), "--format", "hf", "--out", str(tmp_path / "hf"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    cfg, tensors, _ = read_checkpoint(step_dir)
    ours = build_model(cfg, weights=tensors).eval()
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    text = "def quickstart(steps):\n    return [step * 2 for step in range(steps)]\n"
    ids = open_source(step_dir).tokenizer().encode(text).ids
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"] == ids
    tokens = torch.tensor([ids])
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max().item() < 1e-5
        expected = theirs.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=8, do_sample=False)[0, len(ids) :]
    generated = sdk.generate(step_dir, text, max_new_tokens=8, temperature=0)[0]["tokens"]
    assert generated == expected.tolist()[: len(generated)]


@pytest.fixture(scope="module")
def notebook_job(head, tiny_dataset, tmp_path_factory):
    """examples/quickstart.ipynb executed headless against the head, its parameters
    cell replaced by the tiny job's (as papermill would): (notebook, job id, output dir)."""
    out = tmp_path_factory.mktemp("notebook")
    nb = nbformat.read(REPO / "examples" / "quickstart.ipynb", as_version=4)
    parameters = next(cell for cell in nb.cells if "parameters" in cell.metadata.get("tags", []))
    overrides = [item for item in tiny(tiny_dataset, out, steps=6) if not item.startswith(("output_dir=", "data.path="))]
    overrides.append("tracking.system_metrics_s=0.5")  # samples within the job's few seconds
    parameters.source = "\n".join(
        [
            "from pathlib import Path",
            f"ADDRESS = {head.address!r}",
            'JOB = "../jobs/quickstart.yaml"',
            f"OVERRIDES = {overrides!r}",
            f"OUTPUT_DIR = {str(out)!r}",
            f"DATA_PATH = {str(tiny_dataset)!r}",
            'PROMPT = "def main("',
        ]
    )
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(REPO / "examples")}})
    client.execute(env=head.env)  # raises CellExecutionError, with the cell and its traceback, if any cell fails
    nbformat.write(nb, out / "executed.ipynb")  # for a look after a failure
    job_id = next(cell for cell in nb.cells if "sdk.submit(" in cell.source).outputs[0]["text"].strip()
    return nb, job_id, out


def outputs(nb, fragment: str) -> list[dict]:
    return next(cell for cell in nb.cells if cell.cell_type == "code" and fragment in cell.source).outputs


def test_notebook_submits_follows_plots_exports_and_generates(notebook_job, head):
    nb, job_id, out = notebook_job
    followed = "".join(o.get("text", "") for o in outputs(nb, "job.follow()"))
    assert "step 6/6" in followed and "done: quickstart reached step 6" in followed
    assert "lmforge-event" not in followed and "\x1b[" not in followed  # the event stream and escape codes stay hidden
    assert any("image/png" in o.get("data", {}) for o in outputs(nb, "job.plot()"))
    generated = "".join(o["text"] for o in outputs(nb, "sdk.generate(") if o.get("name") == "stdout")
    assert generated.startswith("def main(")
    # The handle's metrics are the run directory's own step rows, read back through the job API.
    from lmforge import sdk

    handle = sdk.job(job_id, head.address, head.token)
    steps = [json.loads(line) for line in (out / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    frame = handle.metrics()
    assert frame[frame.event == "step"]["loss"].tolist() == [row["loss"] for row in steps if "event" not in row]
    assert frame[frame.event == "eval"]["step"].tolist() == [2, 4, 6]
    assert handle.summary() == RunSummary.model_validate_json((out / "quickstart" / "summary.json").read_text())
    assert (out / "quickstart-export" / "model.safetensors").exists()


def test_notebook_run_in_mlflow_has_system_metrics_and_its_registered_export(notebook_job, head):
    """The node the ranks ran on sampled its CPU and memory into the run (as
    system/<host>/...), and the notebook's export is that run's model artifact and a
    version of the model registered under the job's name."""
    from mlflow.tracking import MlflowClient

    from lmforge import sdk

    _, job_id, _ = notebook_job
    summary = sdk.job(job_id, head.address, head.token).summary()
    client = MlflowClient(tracking_uri=summary.mlflow_tracking_uri)
    run = client.get_run(summary.mlflow_run_id)
    (host,) = {key.split("/")[1] for key in run.data.metrics if key.startswith("system/")}  # one node: one monitor
    for name in ("cpu_utilization_percentage", "system_memory_usage_megabytes"):
        assert client.get_metric_history(run.info.run_id, f"system/{host}/{name}"), name
    (version,) = client.search_model_versions("name = 'quickstart'")
    assert (version.run_id, version.source, version.tags["lmforge.step"]) == (run.info.run_id, f"runs:/{run.info.run_id}/model", "6")
    assert "model/model.safetensors" in {a.path for a in client.list_artifacts(run.info.run_id, "model")}


def test_job_commands_find_the_notebooks_job(notebook_job, head):
    _, job_id, _ = notebook_job
    listed = json.loads(run_cli("jobs", "--address", head.address, "--token", head.token, "--json", cwd=REPO).stdout)
    assert {"id": job_id, "job": "quickstart", "status": "SUCCEEDED"}.items() <= next(j for j in listed if j["id"] == job_id).items()
    status = run_cli("status", job_id, "--address", head.address, "--token", head.token, "--json", cwd=REPO)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["summary"]["final_step"] == 6
    logs = run_cli("logs", job_id, "--address", head.address, "--token", head.token, cwd=REPO)
    assert "step 6/6" in logs.stdout and "lmforge-event" not in logs.stdout
    with_events = run_cli("logs", job_id, "--events", "--address", head.address, "--token", head.token, cwd=REPO)
    assert with_events.stdout.count("lmforge-event ") == 6 + 3 + 3  # steps, evaluations, layout, data reader and summary


def scrape(port: int) -> dict[str, list[str]]:
    """The node's Prometheus exposition: each lmforge series' lines by metric name."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("ray_lmforge_"):
            found.setdefault(line.split("{")[0], []).append(line)
    return found


def test_running_job_exports_metrics_and_stops(head, tiny_dataset, tmp_path):
    """`lmforge submit` of a long job: while it runs, every rank's step gauges and the
    job's evaluation and checkpoint gauges are on the node's metrics endpoint; a second
    submission of the same job is refused; `lmforge stop` ends it. It saves by the clock
    alone (every 1.2 s; its step interval is never reached): both ranks at one step, or
    no checkpoint would commit. It trains in fp16, step 3's gradients made to overflow:
    the loss scale skips that step and halves, and the job goes on."""
    job_file = tmp_path / "long.yaml"
    job_file.write_text((REPO / "jobs" / "quickstart.yaml").read_text().replace("name: quickstart", "name: long-run"))
    args = ["--address", head.address, "--token", head.token]
    by_the_clock = ["checkpoint.interval=1000000", "checkpoint.every_minutes=0.02", "checkpoint.keep=100"]
    fp16 = ["train.precision=fp16", "debug.overflow_at_steps=[3]"]
    overrides = [f"--set={item}" for item in [*tiny(tiny_dataset, tmp_path / "out", steps=100_000), *by_the_clock, *fp16]]
    submitted = run_cli("submit", str(job_file), *overrides, *args, cwd=REPO)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    try:
        wanted = {
            "ray_lmforge_tokens_per_second",
            "ray_lmforge_step_seconds",
            "ray_lmforge_mfu",
            "ray_lmforge_data_wait_seconds",
            "ray_lmforge_memory_bytes",
            "ray_lmforge_step",
            "ray_lmforge_eval_loss",
            "ray_lmforge_checkpoint_stall_seconds",
        }
        deadline, found = time.time() + 180, {}
        while time.time() < deadline and not (wanted <= set(found) and len(found["ray_lmforge_step"]) == 2):
            time.sleep(1)
            found = {name: [line for line in lines if 'job="long-run"' in line] for name, lines in scrape(head.metrics_port).items()}
            found = {name: lines for name, lines in found.items() if lines}
        assert wanted <= set(found), f"missing {wanted - set(found)}; the job's log:\n" + run_cli("logs", job_id, *args, cwd=REPO).stdout[-3000:]
        assert {"0", "1"} <= {dict(re.findall(r'(\w+)="([^"]*)"', line)).get("rank") for line in found["ray_lmforge_step"]}
        # The gauges come from the ranks, metrics.jsonl from the driver: wait for its row of step 4 too.
        metrics, deadline = tmp_path / "out" / "long-run" / "metrics.jsonl", time.time() + 60
        while True:
            text = metrics.read_text() if metrics.exists() else ""
            rows = [json.loads(line) for line in text.splitlines()[: None if text.endswith("\n") else -1]]  # whole lines only
            steps = {row["step"]: row for row in rows if "event" not in row}
            if 4 in steps or time.time() > deadline:
                break
            time.sleep(0.5)
        (overflow,) = [row for row in rows if row.get("event") == "overflow"]
        assert (overflow["step"], overflow["loss_scale"], overflow["next_scale"]) == (3, 2.0**16, 2.0**15) and 3 not in steps
        assert steps[2]["loss_scale"] == 2.0**16 and steps[4]["loss_scale"] == 2.0**15
        assert not [row for row in rows if row.get("event") in ("nonfinite", "failure")]
        saved = CheckpointStore(str(tmp_path / "out" / "long-run" / "checkpoints")).committed()
        assert saved, "no checkpoint by the clock"  # the step interval is never reached: the checkpoint gauge's saves were the clock's
        again = run_cli("submit", str(job_file), *overrides, *args, cwd=REPO)
        assert_clean_error(again, "long-run is already running", job_id)
    finally:
        stopped = run_cli("stop", job_id, *args, cwd=REPO)
    assert stopped.returncode == 0 and "stopping" in stopped.stderr
    deadline = time.time() + 60
    while (status := run_cli("status", job_id, *args, cwd=REPO).stdout.strip()) != "STOPPED" and time.time() < deadline:
        time.sleep(0.5)
    assert status == "STOPPED"


def test_remote_job_refusals(head, tiny_dataset, tmp_path):
    """A bad job fails before anything is submitted; a wrong token, an unknown job id
    and an address with nothing behind it are one line each (exit 2), and the SDK
    raises a type for each."""
    from lmforge import sdk
    from lmforge.errors import UserError
    from lmforge.jobs.connection import AuthenticationFailed, ClusterUnreachable, UnknownJob

    args = ["--address", head.address, "--token", head.token]
    before = run_cli("jobs", *args, "--json", cwd=REPO).stdout
    bad = run_cli("submit", "jobs/quickstart.yaml", "--set", "train.micro_batch=0", *args, cwd=REPO)
    assert_clean_error(bad, "train.micro_batch")
    with pytest.raises(UserError, match="train.micro_batch"):
        sdk.submit("jobs/quickstart.yaml", ["train.micro_batch=0"], address=head.address, token=head.token)
    assert run_cli("jobs", *args, "--json", cwd=REPO).stdout == before  # nothing was submitted

    assert_clean_error(run_cli("jobs", "--address", head.address, "--token", "not-the-token", cwd=REPO), "refused", "token")
    with pytest.raises(AuthenticationFailed):
        sdk.jobs(head.address, token="not-the-token")
    assert_clean_error(run_cli("status", "lmforge-nosuch-1234", *args, cwd=REPO), "no job 'lmforge-nosuch-1234'")
    with pytest.raises(UnknownJob):
        sdk.job("lmforge-nosuch-1234", head.address, head.token)
    nowhere = f"http://127.0.0.1:{free_port()}"
    assert_clean_error(run_cli("logs", "x", "--address", nowhere, cwd=REPO), nowhere, "no Ray job API")
    with pytest.raises(ClusterUnreachable):
        sdk.submit("jobs/quickstart.yaml", tiny(tiny_dataset, tmp_path), address=nowhere)
