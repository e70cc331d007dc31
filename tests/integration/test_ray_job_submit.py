"""`ray job submit --working-dir . -- lmforge train jobs/quickstart.yaml` against a
real head started with `ray start --head` (private ports, temp dir and auth token),
stopped by signalling only the process group this test started; its checkpoint
exported with `--format hf` and loaded by transformers."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = [pytest.mark.ray, pytest.mark.slow]
BIN = Path(sys.executable).parent


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def ray_head(tmp_path):
    temp_dir = Path(f"/tmp/lmfh-{uuid.uuid4().hex[:8]}")
    token = temp_dir / "token"
    temp_dir.mkdir()
    token.write_text(uuid.uuid4().hex)
    env = os.environ | {
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_TMPDIR": str(temp_dir),
        "PATH": f"{BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
    }
    env.pop("RAY_ADDRESS", None)
    gcs, dash, agent, agent_grpc, metrics, rt_env, client, nm, om = free_ports(9)
    lo = 20000 + (os.getpid() * 97) % 30000
    while any(lo <= port <= lo + 200 for port in (gcs, dash, agent, agent_grpc, metrics, rt_env, client, nm, om)):
        lo += 211  # the worker port range must not hold a port given to another component
    cmd = [
        str(BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats", "--num-cpus=4",
        f"--port={gcs}", f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", "--include-dashboard=true",
        f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={rt_env}",
        f"--ray-client-server-port={client}", f"--node-manager-port={nm}", f"--object-manager-port={om}",
        f"--min-worker-port={lo}", f"--max-worker-port={lo + 200}", f"--temp-dir={temp_dir}",
    ]
    head = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=open(tmp_path / "head.log", "w"), stderr=subprocess.STDOUT)
    address = f"http://127.0.0.1:{dash}"
    try:
        wait_for_job_api(address, token.read_text(), head, tmp_path / "head.log")
        yield address, env
    finally:
        # The head's whole process group (GCS, raylet, dashboard, workers): nothing of
        # it is needed now, and `ray start --block` lingers on SIGTERM.
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        subprocess.run(["rm", "-rf", str(temp_dir)])


def wait_for_job_api(address: str, token: str, head: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    """Until the head's job API answers (an HTTP request with the cluster's token,
    not a `ray job list` process per try: each of those costs a second of CPU)."""
    request = urllib.request.Request(f"{address}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
    deadline, last = time.time() + timeout_s, None
    while True:
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status == 200:
                    return
                last = f"HTTP {response.status}"
        except OSError as err:  # refused while starting, or an HTTP error
            last = err
        assert head.poll() is None, log.read_text()
        assert time.time() < deadline, f"the job API at {address} did not answer within {timeout_s:.0f}s: {last}"
        time.sleep(0.25)


def test_quickstart_through_ray_job_submit(ray_head, tiny_dataset, tmp_path):
    address, env = ray_head
    out = tmp_path / "out"
    overrides = [
        "model.preset=tiny", "model.vocab_size=512", "train.seq_len=32", "train.global_batch=8",
        "train.micro_batch=2", "train.max_steps=4", "checkpoint.interval=2", "data.prefetch_steps=4",
        f"data.path={tiny_dataset}", "data.eval_fraction=0.1", "eval.interval=2", f"output_dir={out}",
    ]
    cmd = [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", ".", "--",
           "lmforge", "train", "jobs/quickstart.yaml", "--no-progress"]
    for item in overrides:
        cmd += ["--set", item]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "succeeded" in result.stdout + result.stderr
    summary = json.loads((out / "quickstart" / "summary.json").read_text())
    assert summary["final_step"] == 4 and summary["world_size"] == 2
    assert summary["eval_step"] == 4 and summary["eval_loss"] > 0  # the quickstart's held-out loss
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
        expected = theirs.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=8, do_sample=False)[0, len(ids):]
    generated = sdk.generate(step_dir, text, max_new_tokens=8, temperature=0)[0]["tokens"]
    assert generated == expected.tolist()[:len(generated)]
