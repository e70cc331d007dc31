"""`lmforge serve` on the session's Ray cluster, against the official `openai` client and
raw HTTP: two real `lmforge serve` processes (the reference run's model as "teacher";
an int8 quantization of an earlier checkpoint as "student", behind an API key) and
the teacher again with request-level batching and with none (the latter from its
Hugging Face export). Checked: answers equal
generation of each prompt alone, in all three modes; streaming's event format;
errors in OpenAI's shape while serving goes on; the response cache; a client that
disconnects mid-stream frees its sequence; and `lmforge eval judge` end to end.

The judge is a scripted OpenAI-compatible server (a GPT-4-class judge cannot run
here): it records what it is sent and answers by a rule the test knows.
"""

import copy
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx2 as httpx  # the HTTP client the openai package is built on
import jsonschema
import numpy as np
import openai
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from lm_eval.__main__ import cli_evaluate as lm_eval_cli
from mlflow.tracking import MlflowClient
from tokenizers import Tokenizer

from cli import assert_clean_error, run_cli
from conftest import QWEN_TINY, REFERENCE_STEPS, SESSION_MLFLOW, tiny_job
from hf_models import make_hf_model, make_tokenizer
from lm_eval_tasks import HARNESS, HARNESS_TASKS, harness_output, offline
from lmforge import sdk
from lmforge.chat import DEFAULT_CHAT_TEMPLATE
from lmforge.distill.served_teacher import ServedTeacher
from lmforge.distill_jobs.teacher_cache import TeacherTopK
from lmforge.errors import UserError
from lmforge.inference.generate import Generator
from lmforge.inference.sampling import SamplingParams
from lmforge.models import build_model
from lmforge.models.lora import apply_lora, merged
from lmforge.models.lora_config import LoraSpec, is_adapter
from lmforge.models.peft_format import write_peft_dir
from lmforge.models.weights import open_model_dir, write_model_dir
from lmforge.serve.grpc_api import SERVICER
from lmforge.serve.proto import completions_pb2 as pb
from lmforge.serve.proto.completions_pb2_grpc import CompletionsStub
from lmforge.spec import spec_from_dict
from ports import free_port

pytestmark = pytest.mark.ray
KEY = "test-key-not-a-secret"
LONG_PROMPT = 12  # tokens: the routed application's threshold
PROMPTS = ["def ", "import os\n", "class Foo:\n    ", "for i in range(", "return self.", "# A comment\n", "x = [", "if __name__"]


@dataclass
class Serving:
    port: int
    teacher: Path
    student: Path
    teacher_hf: Path  # the teacher exported to a Hugging Face directory
    grpc_port: int
    adapters: dict[str, Path]  # LoRA adapters the teacher's server answers as models of their own: their merged models

    def url(self, prefix: str) -> str:
        return f"http://127.0.0.1:{self.port}/{prefix}"

    def client(self, prefix: str, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url(prefix) + "/v1", api_key=key, max_retries=0)

    def metrics(self, prefix: str) -> dict[str, float]:
        text = httpx.get(self.url(prefix) + "/metrics").text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and not line.startswith("#")}


def step_dir(reference_run, step: int) -> Path:
    return Path(reference_run.run_dir) / "checkpoints" / f"step_{step:08d}"


def wait_healthy(url: str, process=None, log: Path | None = None, timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if process is not None and process.poll() is not None:
            pytest.fail(f"lmforge serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{url} never became healthy" + (f":\n{log.read_text()[-3000:]}" if log else ""))


# Two LoRA adapters of the teacher, on all its linear layers and on two of them.
ADAPTERS = {"teacher-code": LoraSpec(rank=4, alpha=8), "teacher-chat": LoraSpec(rank=2, alpha=4, targets=["q_proj", "down_proj"])}


def lora_adapter(base: Path, out: Path, spec: LoraSpec, seed: int) -> Path:
    """A PEFT directory of random-looking trained adapters on `base`, and beside it
    (`out`-merged, returned) the model with them folded in, with the base's tokenizer."""
    source = open_model_dir(base)
    model = build_model(source.cfg, weights=str(base))
    apply_lora(model, spec, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_b"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    write_peft_dir(out, source.cfg, spec, {k: v for k, v in state.items() if is_adapter(k)}, torch.float32, str(base))
    merged_dir = out.with_name(out.name + "-merged")
    files = {name: (base / name).read_text() for name in ("tokenizer.json", "tokenizer_config.json") if (base / name).is_file()}
    write_model_dir(merged_dir, "lmforge", source.cfg, merged(state, spec), files=files)
    return merged_dir


@pytest.fixture(scope="module")
def serving(ray_session, reference_run, tiny_dataset, tmp_path_factory):
    from ray import serve

    from lmforge.serve.app import application
    from lmforge.serve.options import ServerOptions

    tmp = tmp_path_factory.mktemp("serve")
    teacher, earlier, student = tmp / "teacher", tmp / "earlier", tmp / "student"
    assert run_cli("export", str(step_dir(reference_run, REFERENCE_STEPS)), "--out", str(teacher), cwd=tmp).returncode == 0
    assert run_cli("export", str(step_dir(reference_run, REFERENCE_STEPS - 20)), "--out", str(earlier), cwd=tmp).returncode == 0
    quantized = run_cli(
        "quantize",
        str(earlier),
        "--method",
        "int8",
        "--out",
        str(student),
        "--eval-data",
        str(tiny_dataset),
        "--eval-samples",
        "4",
        "--no-tracking",
        cwd=tmp,
    )
    assert quantized.returncode == 0, quantized.stderr

    adapters = {name: lora_adapter(teacher, tmp / name, spec, seed) for (name, spec), seed in zip(ADAPTERS.items(), (1, 2))}
    port, grpc_port = free_port(), free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, grpc_options={"port": grpc_port, "grpc_servicer_functions": [SERVICER]})
    address = ray_session.get_runtime_context().gcs_address
    processes = []
    adapter_flags = [flag for name in adapters for flag in ("--adapter", f"{name}={tmp / name}")]
    for name, model, env, flags in (("teacher", teacher, {}, adapter_flags), ("student", student, {"LMFORGE_API_KEY": KEY}, [])):
        log = tmp / f"{name}.log"
        command = [
            sys.executable,
            "-m",
            "lmforge",
            "serve",
            str(model),
            "--name",
            name,
            "--route-prefix",
            f"/{name}",
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            "--address",
            address,
            "--cpus-per-replica",
            "0.5",
            "--max-running",
            "4",
            *flags,
        ]
        processes.append((subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=os.environ | env), log))
    # No batching serves the teacher as a Hugging Face directory: the same answers from either format.
    assert run_cli("export", str(teacher), "--format", "hf", "--out", str(tmp / "teacher-hf"), cwd=tmp).returncode == 0
    for mode, model in (("request", teacher), ("off", tmp / "teacher-hf")):
        options = ServerOptions(model=str(model), name="teacher", batching=mode, max_running=4)
        serve.run(application(options, 1, 0.5, 0.0), name=f"teacher-{mode}", route_prefix=f"/{mode}", blocking=False)
    # Routed by length: prompts of LONG_PROMPT tokens or more to a replica of their own.
    routed = ServerOptions(model=str(teacher), name="teacher", max_running=4, long_prompt_tokens=LONG_PROMPT)
    serve.run(application(routed, 1, 0.5, 0.0), name="teacher-routed", route_prefix="/routed", blocking=False)
    serving = Serving(port, teacher, student, tmp / "teacher-hf", grpc_port, adapters)
    for (process, log), prefix in zip(processes, ("teacher", "student")):
        wait_healthy(serving.url(prefix), process, log)
    for mode in ("request", "off", "routed"):
        wait_healthy(serving.url(mode))
    yield serving
    for process, _ in processes:
        process.send_signal(signal.SIGTERM)
    for process, log in processes:
        assert process.wait(60) == 0, log.read_text()[-3000:]
    serve.shutdown()


@pytest.fixture(scope="module")
def reference(serving):
    """The teacher in this process: what each prompt generates alone."""
    return Generator.load(str(serving.teacher))


def alone(reference, prompt: str, max_tokens: int) -> str:
    return reference.generate([prompt], SamplingParams(max_new_tokens=max_tokens, temperature=0))[0].text


def test_echo_scores_prompts_as_a_full_forward_and_token_ids_are_prompts(serving, reference):
    """What lm-evaluation-harness's `local-completions` sends: token-id prompts, `echo`
    with `logprobs` and `max_tokens` 0 or 1. Each prompt token's logprob (the first
    null) and its top 2 are a full forward's log-softmax at the position before it;
    a prefix scores as the start of the whole; token ids answer as their text does; with
    vLLM's `return_tokens_as_token_ids`, the top 16 named by id are the forward's."""
    import torch

    client, tokenizer = serving.client("teacher"), reference.tokenizer
    ids = tokenizer.encode(PROMPTS[2] + "return self.x").ids
    done = client.completions.create(model="teacher", prompt=[ids, ids[:5]], echo=True, max_tokens=0, logprobs=2, temperature=0)
    vocab = min(reference.model.cfg.vocab_size, tokenizer.get_vocab_size())
    with torch.no_grad():
        logprobs = torch.log_softmax(reference.model(torch.tensor([ids]))[0, :-1, :vocab].float(), dim=-1)
    whole, prefix = done.choices
    assert whole.text == tokenizer.decode(ids) and whole.finish_reason == "length"
    assert whole.logprobs.tokens == [tokenizer.decode([i]) for i in ids]
    assert whole.logprobs.token_logprobs[0] is None and whole.logprobs.top_logprobs[0] is None
    want = logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert whole.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    for position, top in enumerate(whole.logprobs.top_logprobs[1:]):
        assert len(top) == 2 and max(top.values()) == pytest.approx(logprobs[position].max().item(), abs=1e-4)
    assert prefix.logprobs.token_logprobs == pytest.approx(whole.logprobs.token_logprobs[:5], abs=1e-5)
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids) + 5, 0)
    # lm-eval's request: the prompt's logprobs, then one greedy token's.
    one = client.completions.create(model="teacher", prompt=[ids], echo=True, max_tokens=1, logprobs=1, temperature=0).choices[0]
    assert one.text == whole.text + alone(reference, tokenizer.decode(ids), 1) and len(one.logprobs.token_logprobs) == len(ids) + 1
    assert one.logprobs.token_logprobs[: len(ids)] == pytest.approx(whole.logprobs.token_logprobs, abs=1e-5)
    streamed = list(client.completions.create(model="teacher", prompt=ids, echo=True, max_tokens=3, temperature=0, stream=True))
    assert streamed[0].choices[0].text == whole.text and "".join(c.choices[0].text for c in streamed).startswith(whole.text)
    as_text = client.completions.create(model="teacher", prompt=PROMPTS[1], max_tokens=8, temperature=0).choices[0].text
    as_ids = client.completions.create(model="teacher", prompt=tokenizer.encode(PROMPTS[1]).ids, max_tokens=8, temperature=0)
    assert as_ids.choices[0].text == as_text == alone(reference, PROMPTS[1], 8)
    # What a served teacher's top-k needs (vLLM's extra): 16 alternatives per token, named by id.
    by_id = client.completions.create(
        model="teacher", prompt=ids, echo=True, max_tokens=0, logprobs=16, extra_body={"return_tokens_as_token_ids": True}
    ).choices[0]
    assert by_id.logprobs.tokens == [f"token_id:{i}" for i in ids]
    best = logprobs.topk(16, dim=-1)
    for position, top in enumerate(by_id.logprobs.top_logprobs[1:]):
        got = {int(name.removeprefix("token_id:")): value for name, value in top.items()}
        assert sorted(got) == sorted(best.indices[position].tolist())
        assert [got[i] for i in best.indices[position].tolist()] == pytest.approx(best.values[position].tolist(), abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="logprobs: at most 20 alternatives per token here \\(--max-logprobs\\), got 21"):
        client.completions.create(model="teacher", prompt=ids, echo=True, max_tokens=0, logprobs=21)


def test_a_served_teacher_gives_the_cache_builders_top_k(serving, reference):
    """`ServedTeacher` against the live server: each position's top 8 ids and
    log-probabilities are what the offline cache's builder computes from the same
    model in this process (temperature 1, stored as fp16), rows in two requests; a
    server that names tokens by text, or refuses k alternatives, is refused in one line."""
    vocab = min(reference.model.cfg.vocab_size, reference.tokenizer.get_vocab_size())
    rows = np.random.default_rng(0).integers(0, vocab, size=(70, 17))  # 64 to a request: two requests
    batch = {"tokens": rows, "sample_id": np.arange(len(rows))}
    served = ServedTeacher(serving.url("teacher") + "/v1", "teacher", 8)
    served.check()
    got, want = served(batch), TeacherTopK([str(serving.teacher)], [1.0], 8, 1.0, vocab, threads=1)(batch)
    assert np.array_equal(got["topk_ids"], want["topk_ids"])
    assert np.allclose(got["topk_logprobs"].astype(np.float32), want["topk_logprobs"].astype(np.float32), atol=2e-3)
    assert served.bytes_received > 0
    with pytest.raises(UserError, match="distill.teacher.url: .* cannot teach: .*logprobs: at most 20 alternatives"):
        ServedTeacher(serving.url("teacher") + "/v1", "teacher", 21).check()


def test_a_served_teacher_builds_the_offline_cache_a_student_trains_from(serving, reference, second_dataset, tmp_path):
    """`distill.teacher: {url, model, top_k}`: `lmforge distill cache` asks the server for
    every sample's top-k (the cache builder's own scoring of the same model, sample by
    sample), records the teacher by URL and model, and a student trains from it. On the
    small second dataset (about 100 samples): the tiny one's 5,600 took 48 s here, the
    JSON of 8 alternatives per token going both ways."""
    served = {"url": serving.url("teacher") + "/v1", "model": "teacher", "top_k": 8}
    job = tiny_job(
        tmp_path,
        second_dataset,
        model=QWEN_TINY | {"n_layers": 1},
        train={"max_steps": 2},
        distill={"teacher": served, "cache": str(tmp_path / "cache")},
    )
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    built = run_cli("distill", "cache", "job.yaml", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert [(t["path"], t["sha256"]) for t in manifest["teachers"]] == [(f"{serving.url('teacher')}/v1#teacher", "served")]
    shard = sorted((tmp_path / "cache").glob("*.parquet"))[0]
    cached = pq.read_table(shard).slice(0, 6).to_pydict()
    tokens = pq.read_table(second_dataset / shard.name, columns=["sample_id", "tokens"]).slice(0, 6).to_pydict()
    assert cached["sample_id"] == tokens["sample_id"]
    vocab = min(reference.model.cfg.vocab_size, reference.tokenizer.get_vocab_size())
    want = TeacherTopK([str(serving.teacher)], [1.0], 8, 1.0, vocab, threads=1)(
        {"tokens": np.array(tokens["tokens"]), "sample_id": tokens["sample_id"]}
    )
    assert np.array_equal(np.array(cached["topk_ids"]), want["topk_ids"])
    assert np.allclose(np.array(cached["topk_logprobs"], dtype=np.float32), want["topk_logprobs"].astype(np.float32), atol=2e-3)
    trained = sdk.train(spec_from_dict(job), show_progress=False)
    assert trained.final_step == 2
    params = MlflowClient(tracking_uri=trained.mlflow_tracking_uri).get_run(trained.mlflow_run_id).data.params
    assert (params["distill.teacher.url"], params["distill.teachers_sha256"]) == (served["url"], "served")


def _step_lines(run_dir: Path, name: str) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / name).read_text().splitlines()]
    return {row["step"]: row for row in rows if "event" not in row}


def _events(run_dir: Path, kind: str) -> list[dict]:
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    return [row for row in map(json.loads, lines) if row.get("event") == kind]


STEPS_FROM_SERVER = 16  # the server goes down at step 2: the steps after it need it


class Forwarder:
    """The teacher's address as the job knows it: a plain HTTP server in this process
    passing each request on to the Serve application. Stopping it is the server going
    down (connections refused); starting it again on the same port, its return."""

    def __init__(self, upstream: str):
        import http.server

        self.upstream, self.port = upstream, free_port()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
                answer = httpx.post(upstream + self.path, content=body, headers=headers, timeout=120)
                self.send_response(answer.status_code)
                self.send_header("Content-Type", answer.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            def log_message(self, *args):
                pass

        self.handler = Handler
        self.start()

    def start(self) -> None:
        import http.server

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), self.handler)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_student_trains_straight_from_a_served_teacher_that_goes_down_mid_run(serving, ray_session, second_dataset, tmp_path):
    """`distill.teacher: {url, model, top_k}` without a cache, through `lmforge train`:
    the feed asks the server for each chunk's top-k as it reads the chunk. The server
    goes down at step 2 (asked with no retries, the attempt fails on it) and comes back
    once the job has recorded the failure: the job resumes from its checkpoint and ends
    with the same samples, step for step, and the same losses (1e-6) as the same student
    taught by the model in-process, top-k at temperature 1."""
    local = tiny_job(
        tmp_path,
        second_dataset,
        name="from-local-teacher",
        model=QWEN_TINY | {"n_layers": 1},
        train={"max_steps": STEPS_FROM_SERVER},
        data={"prefetch_steps": 1, "record_sample_ids": True},  # a chunk per step: the server is asked all along the run
        checkpoint={"interval": 2},
        fault_tolerance={"max_failures": 6, "backoff_s": 0.5},
        distill={"teacher": str(serving.teacher), "top_k": 8},
    )
    server = Forwarder(serving.url("teacher"))
    served = copy.deepcopy(local) | {"name": "from-served-teacher"}
    served["distill"] = {"teacher": {"url": f"http://127.0.0.1:{server.port}/v1", "model": "teacher", "top_k": 8, "max_retries": 0}}
    (tmp_path / "served.yaml").write_text(yaml.safe_dump(served))
    address = ray_session.get_runtime_context().gcs_address
    command = [sys.executable, "-m", "lmforge", "train", "served.yaml", "--address", address]
    driver = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"}
    )
    run_dir = Path(served["output_dir"]) / served["name"]
    try:
        deadline = time.time() + 120
        while not ((run_dir / "metrics.jsonl").is_file() and len(_step_lines(run_dir, "metrics.jsonl")) >= 2):
            assert driver.poll() is None and time.time() < deadline, "the job ended, or never reached step 2"
            time.sleep(0.05)
        server.stop()
        while not _events(run_dir, "failure"):
            assert driver.poll() is None and time.time() < deadline, "the job ended, or never failed"
            time.sleep(0.05)
        server.start()
        output, _ = driver.communicate(timeout=240)
    finally:
        driver.kill()
        server.stop()
    assert driver.returncode == 0, output[-3000:]
    (failure, *_), restored = _events(run_dir, "failure"), _events(run_dir, "restored")
    assert "did not answer (0 retries): Connection error" in failure["cause"] and restored, output[-3000:]
    want_dir = Path(sdk.train(spec_from_dict(local), show_progress=False).run_dir)
    assert _step_lines(run_dir, "samples.jsonl") == _step_lines(want_dir, "samples.jsonl")
    got, want = _step_lines(run_dir, "metrics.jsonl"), _step_lines(want_dir, "metrics.jsonl")
    assert list(got) == list(range(1, STEPS_FROM_SERVER + 1))
    for term in ("loss", "kd_loss"):
        assert [row[term] for row in got.values()] == pytest.approx([row[term] for row in want.values()], rel=1e-6)


def lm_eval(out: Path, model: str, model_args: str, tasks=HARNESS_TASKS, *flags: str) -> tuple[dict, dict]:
    """`lm-eval run` as its users run it, on the shipped tasks (the hub never asked),
    through its console script's entry point in this process (as `run_cli` runs
    lmforge's: an interpreter of its own cost 10-15 CPU-seconds of imports):
    (each task's logged samples by doc_id, each task's metrics)."""
    argv = ["lm-eval", "run", "--model", model, "--model_args", model_args, "--tasks", ",".join(tasks), *flags]
    argv += ["--include_path", str(HARNESS), "--output_path", str(out), "--log_samples", "--batch_size", "1", "--device", "cpu"]
    with pytest.MonkeyPatch.context() as patch:
        for name, value in offline(out).items():
            patch.setenv(name, value)
        patch.setattr(sys, "argv", argv)
        patch.chdir(HARNESS)  # the tasks' data files are named relative to it
        lm_eval_cli()  # raises, with lm-eval's own traceback, where a run fails
    return harness_output(out, tasks)


def assert_scored_alike(ours: dict, theirs: dict, ours_metrics: dict, theirs_metrics: dict) -> None:
    """Every choice's loglikelihood within 1e-4, the same greedy flags, generations and metrics."""
    choices = [json.loads(line) for line in (HARNESS / "tiny_choice.jsonl").read_text().splitlines()]
    assert sorted(ours["lmforge_tiny_choice"]) == sorted(theirs["lmforge_tiny_choice"]) == list(range(len(choices)))
    for doc_id, sample in ours["lmforge_tiny_choice"].items():
        mine, reference = sample["resps"], theirs["lmforge_tiny_choice"][doc_id]["resps"]
        assert len(mine) == len(reference) == len(choices[doc_id]["choices"])
        for (mine_score,), (reference_score,) in zip(mine, reference):
            assert float(mine_score[0]) == pytest.approx(float(reference_score[0]), abs=1e-4), (doc_id, mine, reference)
            assert str(mine_score[1]) == str(reference_score[1])  # greedy or not
    generated = {doc_id: sample["resps"] for doc_id, sample in ours["lmforge_tiny_generation"].items()}
    assert generated == {doc_id: sample["resps"] for doc_id, sample in theirs["lmforge_tiny_generation"].items()} and len(generated) == 4
    assert ours_metrics["lmforge_tiny_choice"]["acc,none"] == theirs_metrics["lmforge_tiny_choice"]["acc,none"]
    assert ours_metrics["lmforge_tiny_generation"]["exact_match,none"] == theirs_metrics["lmforge_tiny_generation"]["exact_match,none"]


def test_lm_evaluation_harness_scores_the_server_and_the_checkpoint_as_its_transformers_backend_does(serving, reference_run, tmp_path, monkeypatch):
    """lm-eval's own `hf` backend on the model's Hugging Face export is the reference
    for `lm-eval run --model local-completions` against `lmforge serve` (loglikelihoods
    from echoed token-id prompts, greedy generations with stop strings) and for
    `lmforge eval harness` on the training checkpoint itself, in its process (logged
    under the checkpoint's MLflow run) and on Ray ranks of the session's cluster, tp2
    (the CLI) and pp2 (the SDK): every choice's loglikelihood within 1e-4, the same
    greedy flags, generations and metrics. A task that does not exist, a layout the
    model cannot take: one line each."""
    from mlflow.tracking import MlflowClient

    served, served_metrics = lm_eval(
        tmp_path / "served",
        "local-completions",
        f"model=teacher,base_url={serving.url('teacher')}/v1/completions,tokenizer={serving.teacher},tokenizer_backend=huggingface,max_retries=1",
    )
    local, local_metrics = lm_eval(tmp_path / "hf", "hf", f"pretrained={serving.teacher_hf},dtype=float32")
    assert_scored_alike(served, local, served_metrics, local_metrics)

    for name, value in offline(tmp_path / "in-process").items():
        monkeypatch.setenv(name, value)
    out, checkpoint = tmp_path / "in-process", step_dir(reference_run, REFERENCE_STEPS)
    flags = ("--include-path", str(HARNESS), "--tracking-uri", SESSION_MLFLOW)
    done = run_cli("eval", "harness", str(checkpoint), "--tasks", ",".join(HARNESS_TASKS), "--out", str(out), *flags, "--json", cwd=HARNESS)
    assert done.returncode == 0, done.stderr[-3000:]
    (in_process, _), report = harness_output(out, HARNESS_TASKS), json.loads(done.stdout)
    assert_scored_alike(in_process, local, report["results"], local_metrics)
    assert report["mlflow_run_id"] == reference_run.mlflow_run_id
    logged = MlflowClient(SESSION_MLFLOW).get_metric_history(reference_run.mlflow_run_id, "harness/lmforge_tiny_choice/acc/none")
    assert [(m.step, m.value) for m in logged] == [(REFERENCE_STEPS, local_metrics["lmforge_tiny_choice"]["acc,none"])]

    unknown = run_cli("eval", "harness", str(checkpoint), "--tasks", "no_such_task", *flags, cwd=HARNESS)
    assert_clean_error(unknown, "--tasks: no task named no_such_task")
    tasks = ("--tasks", ",".join(HARNESS_TASKS), "--include-path", str(HARNESS), "--no-tracking")
    tp2 = run_cli("eval", "harness", str(checkpoint), *tasks, "--set", "parallel.tp=2", "--out", str(tmp_path / "tp2"), "--json", cwd=HARNESS)
    assert tp2.returncode == 0, tp2.stderr[-3000:]
    assert_scored_alike(harness_output(tmp_path / "tp2", HARNESS_TASKS)[0], local, json.loads(tp2.stdout)["results"], local_metrics)
    monkeypatch.chdir(HARNESS)  # the tasks' data files are named relative to it
    pp2 = sdk.evaluate_harness(str(checkpoint), list(HARNESS_TASKS), include_path=str(HARNESS), out=str(tmp_path / "pp2"), tracking=False, pp=2)
    assert_scored_alike(harness_output(tmp_path / "pp2", HARNESS_TASKS)[0], local, pp2.results, local_metrics)
    for layout, message in (
        ("parallel.dp=2", "--set parallel.dp=2: eval harness takes parallel.tp and parallel.pp"),
        ("parallel.tp=3", "--set parallel.tp: model.n_heads: 4 is not divisible by parallel.tp 3"),
        ("parallel.pp=3", "--set parallel.pp: 2 layers cannot fill 3 pipeline stages"),
    ):
        assert_clean_error(run_cli("eval", "harness", str(checkpoint), *tasks, "--set", layout, cwd=HARNESS), message)


def test_lm_evaluation_harness_chats_with_the_server(serving, reference, tmp_path):
    """`lm-eval run --model local-chat-completions --apply_chat_template`: each task
    prompt sent as a user message, answered greedily as the model answers the chat the
    server's template renders, up to the task's stop string."""
    import copy

    from lmforge.chat import chat_renderer, chat_template_of

    model_args = f"model=teacher,base_url={serving.url('teacher')}/v1/chat/completions,max_retries=1"
    chats, _ = lm_eval(tmp_path / "chat", "local-chat-completions", model_args, ["lmforge_tiny_chat"], "--apply_chat_template")
    samples = list(chats["lmforge_tiny_chat"].values())
    render = chat_renderer(chat_template_of(serving.teacher))
    params = SamplingParams(max_new_tokens=8, temperature=0, stop=["<|user|>"])
    assert len(samples) == 4
    for sample in samples:
        chat = render([{"role": "user", "content": sample["doc"]["prompt"]}])
        want = reference.generate([chat], copy.deepcopy(params), chats=True)[0].text.split("<|user|>")[0]
        assert sample["resps"] == [[want]], sample
    assert len({sample["resps"][0][0] for sample in samples}) > 1  # answers that depend on the prompt (a tiny model's)


def test_openai_client_completions_chat_and_streaming(serving, reference):
    client = serving.client("teacher")
    assert [m.id for m in client.models.list().data] == ["teacher", *ADAPTERS]  # the base first, then its adapters

    done = client.completions.create(model="teacher", prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=2)
    choice = done.choices[0]
    assert choice.text == alone(reference, PROMPTS[0], 12)
    assert done.usage.prompt_tokens == len(reference.tokenizer.encode(PROMPTS[0]).ids)
    assert done.usage.completion_tokens == len(choice.logprobs.tokens) and choice.finish_reason in ("length", "stop")
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    assert all(lp <= max(top.values()) + 1e-6 for lp, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs))

    streamed = list(client.completions.create(model="teacher", prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True, seed=1))
    assert "".join(chunk.choices[0].text for chunk in streamed) == choice.text
    assert streamed[-1].choices[0].finish_reason == choice.finish_reason

    messages = [{"role": "user", "content": "Write a loop."}]
    chat = client.chat.completions.create(model="teacher", messages=messages, max_completion_tokens=10, temperature=0)
    rendered = DEFAULT_CHAT_TEMPLATE.replace(
        "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}", "<|user|>\nWrite a loop.\n"
    ).replace("{% if add_generation_prompt %}<|assistant|>\n{% endif %}", "<|assistant|>\n")
    assert chat.choices[0].message.content == alone(reference, rendered, 10)
    assert chat.choices[0].message.role == "assistant"

    chunks = list(
        client.chat.completions.create(
            model="teacher", messages=messages, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == chat.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == chat.usage.total_tokens

    # The raw events: `data: {json}` lines, the last `data: [DONE]`.
    with httpx.stream(
        "POST",
        serving.url("teacher") + "/v1/completions",
        json={"model": "teacher", "prompt": PROMPTS[1], "max_tokens": 5, "temperature": 0, "stream": True},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_adapters_answer_as_their_merged_models_beside_the_base(serving, reference):
    """`lmforge serve --adapter NAME=DIR` (PEFT directories): each request's `model`
    picks its adapter, requests for both adapters and the base decode in one
    continuous batch, and each answers greedily as its merged model does alone;
    /v1/models lists the adapters with the base as their parent."""
    client = serving.client("teacher")
    listed = {model.id: model for model in client.models.list().data}
    assert set(listed) == {"teacher", *ADAPTERS} and all(getattr(listed[name], "parent", None) == "teacher" for name in ADAPTERS)
    asks = [(model, prompt) for prompt in PROMPTS[:3] for model in ("teacher", *ADAPTERS)]
    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda ask: client.completions.create(model=ask[0], prompt=ask[1], max_tokens=10, temperature=0), asks))
    merged_models = {name: Generator.load(str(path)) for name, path in serving.adapters.items()} | {"teacher": reference}
    for (model, prompt), answer in zip(asks, answers):
        assert answer.model == model
        assert answer.choices[0].text == alone(merged_models[model], prompt, 10), (model, prompt)
    assert len({answer.choices[0].text for answer in answers[:3]}) > 1, "the adapters changed nothing"
    with pytest.raises(openai.BadRequestError, match="'teacher-none' is not served here"):
        client.completions.create(model="teacher-none", prompt="def ", max_tokens=2)


def test_sampling_options_n_seed_and_stop(serving, reference):
    client = serving.client("teacher")
    sampled = dict(model="teacher", prompt=PROMPTS[2], max_tokens=16, temperature=1.0, n=3)
    reused = 'lmforge:prefix_cache_hits_total{model_name="teacher"}'
    before = serving.metrics("teacher").get(reused, 0)
    first = client.completions.create(**sampled, seed=7, extra_body={"top_k": 50})
    # One prefill for the three choices: the other two copy all of the prompt but its last token.
    assert serving.metrics("teacher")[reused] - before >= 2 * (first.usage.prompt_tokens - 1)
    again = client.completions.create(**sampled, seed=7, extra_body={"top_k": 50})
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices], "a seed repeats its samples"
    assert len({c.text for c in first.choices}) > 1, "each choice samples on its own"

    greedy = alone(reference, PROMPTS[3], 24)
    stop = greedy[3:5]
    cut = client.completions.create(model="teacher", prompt=PROMPTS[3], max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == greedy[: greedy.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_greedy_outputs_are_identical_with_continuous_request_and_no_batching(serving, reference):
    modes = ("teacher", "request", "off")
    jobs = [(mode, prompt) for prompt in PROMPTS for mode in modes]
    before = serving.metrics("teacher")

    def ask(job):
        mode, prompt = job
        # A seed apart from the cache key: each request is generated, not answered from the cache.
        reply = serving.client(mode).completions.create(model="teacher", prompt=prompt, max_tokens=24, temperature=0, seed=hash(job) % 1000)
        return reply.choices[0].text

    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = dict(zip(jobs, pool.map(ask, jobs)))
    for prompt in PROMPTS:
        expected = alone(reference, prompt, 24)
        assert [texts[(mode, prompt)] for mode in modes] == [expected] * 3, prompt
    after = serving.metrics("teacher")
    steps = after['lmforge:batch_size_count{model_name="teacher"}'] - before.get('lmforge:batch_size_count{model_name="teacher"}', 0)
    single = after['lmforge:batch_size_bucket{le="1.0",model_name="teacher"}'] - before.get(
        'lmforge:batch_size_bucket{le="1.0",model_name="teacher"}', 0
    )
    assert single < steps, "continuous batching never decoded two sequences in one step"
    assert after['lmforge:num_requests_running{model_name="teacher"}'] == 0


def test_bad_requests_get_openai_errors_and_serving_goes_on(serving):
    url = serving.url("teacher") + "/v1/completions"
    ok = {"model": "teacher", "prompt": "def ", "max_tokens": 4}
    cases = [
        (ok | {"prompt": "x " * 400}, "prompt", "context_length_exceeded"),
        (ok | {"max_tokens": 1000}, "max_tokens", "context_length_exceeded"),
        (ok | {"model": "gpt-4"}, "model", "model_not_found"),
        (ok | {"n": 99}, "n", None),
        (ok | {"temperature": -1}, "temperature", None),
        ({"model": "teacher"}, "prompt", None),
        (
            ok | {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format.json_schema.schema",
            None,
        ),
    ]
    for body, param, code in cases:
        response = httpx.post(url, json=body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error
        assert error["message"]
    malformed = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert malformed.status_code == 400 and "malformed JSON" in malformed.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        serving.client("teacher").completions.create(model="nope", prompt="x", max_tokens=2)
    assert httpx.post(url, json=ok).status_code == 200
    assert serving.metrics("teacher")['lmforge:request_errors_total{model_name="teacher",status="400"}'] >= len(cases) + 2


VERDICT = {
    "type": "object",
    "properties": {"winner": {"enum": ["A", "B", "tie"]}, "score": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["winner", "score"],
    "additionalProperties": False,
}


def test_structured_output_always_parses(serving):
    """A judge's verdict as a JSON schema (chat, sampled choices, streamed too) and a
    choice (completions, vLLM's `structured_outputs`): every answer validates; a
    server batching whole requests refuses them with a 400."""
    client = serving.client("teacher")
    verdict = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}}
    messages = [{"role": "user", "content": "Which answer is better, A or B?"}]
    chat = client.chat.completions.create(model="teacher", messages=messages, max_tokens=48, temperature=1.0, n=4, seed=3, response_format=verdict)
    streamed = client.chat.completions.create(model="teacher", messages=messages, max_tokens=48, temperature=0, response_format=verdict, stream=True)
    answers = [choice.message.content for choice in chat.choices] + ["".join(c.choices[0].delta.content or "" for c in streamed if c.choices)]
    for answer in answers:
        jsonschema.validate(json.loads(answer), VERDICT)
    assert all(choice.finish_reason == "stop" for choice in chat.choices)
    colours = ["red", "green", "dark blue"]
    picked = client.completions.create(
        model="teacher", prompt=PROMPTS[1], max_tokens=8, temperature=1.0, n=4, seed=5, extra_body={"structured_outputs": {"choice": colours}}
    )
    assert all(choice.text in colours for choice in picked.choices), [c.text for c in picked.choices]
    refused = httpx.post(serving.url("request") + "/v1/chat/completions", json={"model": "teacher", "messages": messages, "response_format": verdict})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"


def test_grpc_completions_beside_http_with_the_same_checks_and_key(serving, reference):
    """lmforge.v1.Completions through Ray Serve's gRPC proxy with a real grpcio client:
    a whole completion and a stream give what generation alone gives (token ids as
    their text), a JSON schema constrains it, a bad field or a missing key is the gRPC
    code that means it, and both servers keep serving."""
    stub = CompletionsStub(grpc.insecure_channel(f"127.0.0.1:{serving.grpc_port}"))
    teacher = [("application", "teacher")]
    whole = stub.Complete(pb.CompletionRequest(model="teacher", prompt=PROMPTS[0], max_tokens=12, temperature=0), metadata=teacher)
    assert whole.choices[0].text == alone(reference, PROMPTS[0], 12) and whole.model == "teacher"
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens > 0
    ids = reference.tokenizer.encode(PROMPTS[3]).ids
    asked = pb.CompletionRequest(model="teacher", prompt_token_ids=ids, max_tokens=10, temperature=0, ignore_eos=True, seed=4)
    chunks = list(stub.CompleteStream(asked, metadata=teacher))
    assert "".join(c.choice.text for c in chunks if c.HasField("choice")) == alone(reference, PROMPTS[3], 10)
    assert chunks[-1].HasField("usage") and chunks[-1].usage.completion_tokens == 10
    assert [c.choice.finish_reason for c in chunks if c.HasField("choice") and c.choice.finish_reason] == ["length"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    shaped = stub.Complete(
        pb.CompletionRequest(model="teacher", prompt="x", max_tokens=16, temperature=1.0, json_schema=json.dumps(schema)), metadata=teacher
    )
    jsonschema.validate(json.loads(shaped.choices[0].text), schema)

    refusals = [
        (pb.CompletionRequest(model="teacher", prompt="x", temperature=7), teacher, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (pb.CompletionRequest(model="teacher", prompt="x", json_schema="{not json"), teacher, grpc.StatusCode.INVALID_ARGUMENT, "json_schema"),
        (pb.CompletionRequest(model="student", prompt="x"), [("application", "student")], grpc.StatusCode.UNAUTHENTICATED, "API key"),
    ]
    for message, metadata, code, named in refusals:
        with pytest.raises(grpc.RpcError) as refused:
            stub.Complete(message, metadata=metadata)
        assert refused.value.code() == code and named in refused.value.details(), refused.value.details()
    keyed = [("application", "student"), ("authorization", f"Bearer {KEY}")]
    assert stub.Complete(pb.CompletionRequest(model="student", prompt="x", max_tokens=2), metadata=keyed).choices[0].finish_reason
    assert serving.client("teacher").completions.create(model="teacher", prompt="x", max_tokens=2).choices


def assert_served_alike(serving, onnx_model: Path) -> None:
    """The ONNX Runtime replica on the session's Serve beside the torch one: the same answers."""
    from ray import serve

    from lmforge.serve.app import application
    from lmforge.serve.options import ServerOptions

    options = ServerOptions(model=str(onnx_model), name="teacher", backend="onnxruntime", max_running=4, stream_interval=4)
    serve.run(application(options, 1, 0.5, 0.0), name="teacher-onnx", route_prefix="/onnx", blocking=False)
    try:
        wait_healthy(serving.url("onnx"))
        onnx, torch_replica = serving.client("onnx"), serving.client("teacher")
        asks = (
            {"prompt": PROMPTS[:3], "max_tokens": 12, "temperature": 0, "logprobs": 2},
            {"prompt": PROMPTS[3], "max_tokens": 10, "temperature": 0.9, "seed": 7, "n": 2},
            {"prompt": PROMPTS[4], "max_tokens": 0, "echo": True, "logprobs": 1},
        )
        with ThreadPoolExecutor(len(asks)) as pool:  # together: sequences share the engine's steps
            got = list(pool.map(lambda ask: onnx.completions.create(model="teacher", **ask), asks))
        for ask, answer in zip(asks, got):
            want = torch_replica.completions.create(model="teacher", **ask)
            assert [c.text for c in answer.choices] == [c.text for c in want.choices], ask
            for mine, theirs in zip(answer.choices, want.choices):
                if theirs.logprobs is not None:
                    assert [p or 0.0 for p in mine.logprobs.token_logprobs] == pytest.approx(
                        [p or 0.0 for p in theirs.logprobs.token_logprobs], abs=1e-4
                    )
        streamed = onnx.completions.create(model="teacher", prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=1, stream=True)
        streamed = [chunk for chunk in streamed if chunk.choices]
        assert "".join(chunk.choices[0].text for chunk in streamed) == got[0].choices[0].text
        # --stream-interval 4: the first chunk at once (with what has arrived by then), then at
        # least 4 tokens a chunk but the last (every chunk has its logprobs)
        sizes = [len(chunk.choices[0].logprobs.tokens) for chunk in streamed]
        assert sum(sizes) == 12 and len(sizes) <= 4 and min(sizes[1:-1], default=4) >= 4, sizes
        picked = onnx.completions.create(
            model="teacher", prompt=PROMPTS[1], max_tokens=4, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
        )
        assert picked.choices[0].text in ("yes", "no")
    finally:
        serve.delete("teacher-onnx")


def test_onnx_runtime_export_generates_and_serves_lmforges_tokens(serving, reference, reference_run, tmp_path):
    """`lmforge export --format onnx` of the training checkpoint (onnxruntime-genai's
    builder, fp32 and int4 for CPU), then `lmforge generate --backend onnxruntime`:
    fp32's greedy tokens are lmforge's own; int4 generates. The fp32 export served with
    `--backend onnxruntime` answers the `openai` client as the torch replica does:
    greedy and seeded sampled choices, streamed text (4 tokens a chunk with
    `--stream-interval 4`), generated and echoed prompt logprobs (within 1e-4), a
    structured choice. A family the builder does not build, a
    precision it does not make, and the torch backend on an ONNX directory are one line
    each, with nothing written."""
    checkpoint, fp32, int4 = step_dir(reference_run, REFERENCE_STEPS), tmp_path / "onnx-fp32", tmp_path / "onnx-int4"
    for out, dtype in ((fp32, "fp32"), (int4, "int4")):
        exported = run_cli("export", str(checkpoint), "--format", "onnx", "--dtype", dtype, "--out", str(out), cwd=tmp_path)
        assert exported.returncode == 0, exported.stderr[-3000:]
    onnx_tokenizer = Tokenizer.from_file(str(fp32 / "tokenizer.json"))  # the export's (the builder would save a Qwen2 one)
    assert [onnx_tokenizer.encode(p).ids for p in PROMPTS] == [reference.tokenizer.encode(p).ids for p in PROMPTS]
    prompts = [item for prompt in PROMPTS[:4] for item in ("--prompt", prompt)]
    for out in (fp32, int4):
        done = run_cli(
            "generate", str(out), "--backend", "onnxruntime", *prompts, "--temperature", "0", "--max-new-tokens", "16", "--json", cwd=tmp_path
        )
        assert done.returncode == 0, done.stderr
        answers = [json.loads(line) for line in done.stdout.splitlines()]
        want = reference.generate(PROMPTS[:4], SamplingParams(max_new_tokens=16, temperature=0))
        if out == fp32:
            assert [a["tokens"] for a in answers] == [w.tokens for w in want] and [a["text"] for a in answers] == [w.text for w in want]
        else:
            assert all(a["tokens"] for a in answers) and sum(a["tokens"] == w.tokens for a, w in zip(answers, want)) >= 1

    assert_served_alike(serving, fp32)

    moe = tmp_path / "moe"
    make_hf_model(moe, "qwen3-moe", make_tokenizer(tmp_path / "tokenizer"))
    assert_clean_error(
        run_cli("export", str(moe), "--format", "onnx", "--out", str(tmp_path / "no"), cwd=tmp_path), "--format onnx", "Qwen3MoeForCausalLM"
    )
    assert_clean_error(
        run_cli("export", str(checkpoint), "--format", "onnx", "--dtype", "int8", "--out", str(tmp_path / "no"), cwd=tmp_path), "--dtype"
    )
    assert_clean_error(run_cli("generate", str(fp32), "--prompt", "x", cwd=tmp_path), "--backend onnxruntime")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moe", "onnx-fp32", "onnx-int4", "tokenizer"]


def test_routing_by_length_sends_long_prompts_to_their_own_replica(serving, reference):
    """Behind the length router: short and long prompts (completions, chats, streamed)
    are answered as generation alone answers them, each counted on its pool; a bad
    request gets the replica's own 400."""
    client = serving.client("routed")
    counted = lambda pool: serving.metrics("routed").get(f'lmforge:routed_requests_total{{model_name="teacher",pool="{pool}"}}', 0)
    short, long = PROMPTS[0], "import os\n" * 8
    assert len(reference.tokenizer.encode(short).ids) < LONG_PROMPT <= len(reference.tokenizer.encode(long).ids)
    before = {pool: counted(pool) for pool in ("short", "long")}
    for prompt in (short, long):
        whole = client.completions.create(model="teacher", prompt=prompt, max_tokens=8, temperature=0, seed=1)
        streamed = client.completions.create(model="teacher", prompt=prompt, max_tokens=8, temperature=0, seed=2, stream=True)
        assert whole.choices[0].text == "".join(c.choices[0].text for c in streamed) == alone(reference, prompt, 8)
    chat = client.chat.completions.create(model="teacher", messages=[{"role": "user", "content": long}], max_tokens=4, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert (counted("short") - before["short"], counted("long") - before["long"]) == (2, 3)
    refused = httpx.post(serving.url("routed") + "/v1/completions", json={"model": "teacher", "prompt": long, "temperature": 9})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "temperature"
    assert client.models.list().data[0].id == "teacher"


def test_replicas_fixed_or_autoscaled_and_a_gpu_each_on_gpu_clusters(tmp_path):
    """The deployment `lmforge serve` asks Serve for (its config only: no GPU here)."""
    from lmforge.serve.app import application
    from lmforge.serve.options import ServerOptions

    options = ServerOptions(model=str(tmp_path), name="m", max_running=4, max_waiting=12)
    fixed = application(options, 2, 1.0, 1.0)._bound_deployment
    assert fixed.num_replicas == 2 and fixed.ray_actor_options["num_gpus"] == 1.0
    assert fixed.max_ongoing_requests == 16  # the engine's queue, not Serve's default of 5, bounds a replica
    assert fixed._deployment_config.max_queued_requests == 12  # and Serve's proxy queues that many more at most, then 503
    auto = application(options, "auto", 1.0, 0.0, max_replicas=3)._bound_deployment
    scaling = auto._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (1, 3, 4)
    assert auto.ray_actor_options["num_gpus"] == 0.0


def test_api_key_guards_the_v1_routes(serving):
    with pytest.raises(openai.AuthenticationError):
        serving.client("student").models.list()
    with pytest.raises(openai.AuthenticationError):
        serving.client("student", "wrong").models.list()
    assert [m.id for m in serving.client("student", KEY).models.list().data] == ["student"]
    assert httpx.get(serving.url("student") + "/health").status_code == 200
    assert httpx.get(serving.url("student") + "/metrics").status_code == 401
    assert httpx.get(serving.url("student") + "/metrics", headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_identical_greedy_requests_are_answered_from_the_cache(serving):
    hits = 'lmforge:response_cache_hits_total{model_name="teacher"}'
    before = serving.metrics("teacher").get(hits, 0)
    request = dict(model="teacher", prompt="def cached(", max_tokens=8, temperature=0)
    first = serving.client("teacher").completions.create(**request)
    second = serving.client("teacher").completions.create(**request)
    assert serving.metrics("teacher")[hits] == before + 1
    assert second.choices[0].text == first.choices[0].text and second.id != first.id
    streamed = list(serving.client("teacher").completions.create(**request, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == first.choices[0].text
    assert serving.metrics("teacher")[hits] == before + 2


def test_a_client_that_disconnects_mid_stream_frees_its_sequence(serving):
    steps = 'lmforge:batch_size_sum{model_name="teacher"}'
    running = 'lmforge:num_requests_running{model_name="teacher"}'
    before = serving.metrics("teacher").get(steps, 0)
    max_tokens = 250
    with httpx.stream(
        "POST",
        serving.url("teacher") + "/v1/completions",
        json={
            "model": "teacher",
            "prompt": "def ",
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "seed": 3,
            "stop": ["never appears \x00"],
        },
    ) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.time() + 20
    while serving.metrics("teacher")[running] != 0 and time.time() < deadline:
        time.sleep(0.05)
    assert serving.metrics("teacher")[running] == 0
    time.sleep(1.0)  # had it kept decoding, it would reach max_tokens by now
    generated = serving.metrics("teacher")[steps] - before
    assert generated < max_tokens - 1, "the sequence kept decoding after its client left"
    assert serving.client("teacher").completions.create(model="teacher", prompt="x", max_tokens=2, temperature=0).choices


# -- the judge -------------------------------------------------------------------------

ANSWER = re.compile(r"\[The Start of Assistant ([AB])'s Answer\]\n(.*?)\n\[The End of Assistant \1's Answer\]", re.S)


class ScriptedJudge:
    """An OpenAI-compatible chat endpoint that records each request and answers by the
    model asked for: "longer" (the longer answer wins, equal lengths tie), "always-a",
    "garbage" (no verdict at all)."""

    def __init__(self):
        import uvicorn
        from fastapi import FastAPI, Header

        self.requests, self.keys, app = [], set(), FastAPI()

        @app.get("/v1/models")
        def models():
            return {"object": "list", "data": [{"id": "longer", "object": "model", "created": 0, "owned_by": "test"}]}

        @app.post("/v1/chat/completions")
        def chat(body: dict, authorization: str = Header("")):
            self.requests.append(body)
            self.keys.add(authorization)
            shown = dict(ANSWER.findall(body["messages"][-1]["content"]))
            longer = "C" if len(shown["A"]) == len(shown["B"]) else "A" if len(shown["A"]) > len(shown["B"]) else "B"
            reply = {"longer": f"A has more detail [[B]]? No: [[{longer}]]", "always-a": "A", "garbage": "I cannot decide."}[body["model"]]
            return {
                "id": "j",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            time.sleep(0.05)

    def url(self, model: str) -> str:
        return f"http://127.0.0.1:{self.port}/v1#{model}"


def test_judge_compares_student_and_teacher_in_both_orders(serving, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": p} for p in PROMPTS[:4]] + [{"messages": [{"role": "user", "content": "Say hi."}]}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    judge = ScriptedJudge()
    try:

        def run(model: str, out: str, a: str = serving.url("student") + "/v1"):
            result = run_cli(
                "eval",
                "judge",
                "--a",
                a,
                "--b",
                serving.url("teacher") + "/v1",
                "--judge",
                judge.url(model),
                "--prompts",
                str(prompts),
                "--out",
                str(tmp_path / out),
                "--max-tokens",
                "16",
                "--a-key",
                KEY,
                "--judge-key",
                "judge-key",
                "--tracking-uri",
                SESSION_MLFLOW,
                "--json",
                cwd=tmp_path,
            )
            assert result.returncode == 0, result.stderr
            return json.loads(result.stdout)

        report = run("longer", "longer")
        assert report["prompts"] == len(rows) and len(judge.requests) == 2 * len(rows)
        for row in report["per_prompt"]:
            sent = [dict(ANSWER.findall(r["messages"][-1]["content"])) for r in judge.requests if row["question"] in r["messages"][-1]["content"]]
            # Both orders, exactly the answers the two servers gave.
            assert sorted((s["A"], s["B"]) for s in sent) == sorted([(row["answer_a"], row["answer_b"]), (row["answer_b"], row["answer_a"])])
            a, b = len(row["answer_a"]), len(row["answer_b"])
            assert row["outcome"] == ("tie" if a == b else "win" if a > b else "loss")
        assert all(r["messages"][0]["role"] == "system" and "[[C]]" in r["messages"][0]["content"] for r in judge.requests)
        assert judge.keys == {"Bearer judge-key"}  # its own key only: never the student's
        assert report["counts"]["inconsistent"] == 0 and sum(report["rates"].values()) == pytest.approx(1.0)
        assert [json.loads(line) for line in (tmp_path / "longer" / "judgments.jsonl").read_text().splitlines()] == report["per_prompt"]

        # A as the student's directory, answered in the judge's own process: the same answers as served.
        biased = run("always-a", "always-a", a=str(serving.student))
        assert biased["counts"]["inconsistent"] == len(rows) and biased["rates"]["inconsistent"] == 1.0
        assert [row["answer_a"] for row in biased["per_prompt"]] == [row["answer_a"] for row in report["per_prompt"]]
        unparsable = run("garbage", "garbage")
        assert unparsable["counts"]["unparsable"] == len(rows) and unparsable["unparsable"] == 2 * len(rows)

        from mlflow.tracking import MlflowClient

        logged = MlflowClient(SESSION_MLFLOW).get_run(biased["mlflow_run_id"])
        assert logged.data.metrics["inconsistent_rate"] == 1.0 and logged.data.params["b"].endswith("#teacher")
    finally:
        judge.server.should_exit = True
