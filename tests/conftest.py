"""Shared fixtures: a private Ray cluster, a small real corpus and its prepared dataset.

The corpus is a slice of this interpreter's standard library (real text, no
download). Ray gets its own temp dir and auth token so tests never touch another
Ray on the machine.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from hf_models import LAYOUTS
from s3_server import s3_environment, s3_server

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["suite_timing"]
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _private_ray_env() -> dict:
    """Auth and temp-dir settings for every Ray process this test session starts.

    Set at import, before anything imports ray: Ray reads RAY_AUTH_MODE once per process.
    """
    # Unix socket paths must stay short, so not under pytest's deep tmp dir.
    root = Path(tempfile.mkdtemp(prefix="lmf-", dir="/tmp"))
    token_path = root / "auth_token"
    token_path.write_text(uuid.uuid4().hex)
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path), "RAY_TMPDIR": str(root)}
    os.environ.update(env)
    return env | {"root": str(root)}


PRIVATE_RAY_ENV = _private_ray_env()
atexit.register(shutil.rmtree, PRIVATE_RAY_ENV["root"], True)
os.environ.update(s3_environment())  # before Ray starts: its processes inherit the S3 settings


# One MLflow store for the session's runs: a new SQLite store costs each run 1.5 s of
# schema migrations. Runs stay apart: a job's run is found by its name and checkpoint
# directory, and every test has its own.
SESSION_MLFLOW = f"sqlite:///{PRIVATE_RAY_ENV['root']}/mlflow.db"


# Test modules whose torchrun launches (their `CASES`) need no Ray and nothing another
# test makes: they run from the session's start in the background at the idle
# scheduling class, on the cores the other tests leave idle, and the modules' tests
# run last, when the launches are done or nearly (tests/integration/parity.py).
BACKGROUND_LAUNCHES = ("test_deepspeed_engine.py", "test_engine_parity.py")
# Meanwhile, first the tests that leave a core idle most (the unit tests compute in this
# one process; serving and remote jobs wait on servers and clients), then the rest:
# meant to put the launches where cores idle (measured: 1,261 s against 1,271 s without
# this order, within the machine's noise; docs/testing.md).
IDLE_MOST = ("test_serve.py", "test_remote_jobs.py", "test_capacity.py", "test_serve_requests.py")


def pytest_collection_modifyitems(items):
    def place(item) -> int:
        if item.path.name in BACKGROUND_LAUNCHES:
            return 3
        return 0 if item.path.parent.name == "unit" else 1 if item.path.name in IDLE_MOST else 2

    items.sort(key=place)  # stable: each file's own order kept


@pytest.fixture(scope="session", autouse=True)
def launches_in_the_background(request, tmp_path_factory):
    modules = {item.path.name: item.module for item in request.session.items if item.path.name in BACKGROUND_LAUNCHES}
    if not modules:
        yield
        return
    import parity  # importable once a module beside it is collected

    parity.run_in_background([parity.launches_of(modules[name], tmp_path_factory) for name in BACKGROUND_LAUNCHES if name in modules])
    yield
    parity.stop_background()


@pytest.fixture(scope="session")
def private_ray_env():
    return PRIVATE_RAY_ENV


@pytest.fixture
def one_rank(tmp_path):
    """A torch.distributed group of this process alone (gloo), for an engine in a unit test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg-store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def ray_session(private_ray_env):
    import logging

    import ray

    from multinode import IDLE_WORKERS_PER_NODE
    from ports import free_port

    # Ray 2.60 starts its API server even without the dashboard: on a port of its own.
    ray.init(
        address="local",
        num_cpus=6,
        include_dashboard=False,
        dashboard_port=free_port(),
        # Idle worker processes kept for the next job's reads and ranks, not killed as
        # soon as the Serve replicas and a job's actors outnumber the 6 CPUs.
        _system_config={"num_workers_soft_limit": IDLE_WORKERS_PER_NODE},
        log_to_driver=False,
        logging_level=logging.WARNING,
        _temp_dir=private_ray_env["root"],
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """About 40 real source files: enough text for a few hundred samples of 32 tokens."""
    from lmforge.data.corpus import stdlib_files

    out = tmp_path_factory.mktemp("corpus")
    files = [f for f in stdlib_files() if "/test" not in f][::40][:40]
    for i, path in enumerate(files):
        shutil.copy(path, out / f"{i:03d}_{Path(path).name}")
    return out


@pytest.fixture(scope="session")
def tiny_dataset(ray_session, tiny_corpus, tmp_path_factory) -> Path:
    from lmforge.data.prepare import prepare_dataset
    from lmforge.data.prepare_options import PrepareOptions

    out = tmp_path_factory.mktemp("data") / "tiny-32"
    # One document in ten held out: the held-out split that `eval` measures.
    prepare_dataset(PrepareOptions(source=str(tiny_corpus), out=str(out), seq_len=32, vocab_size=512, eval_fraction=0.1, show_progress=False))
    return out


@pytest.fixture(scope="session")
def second_dataset(ray_session, tiny_dataset, tmp_path_factory) -> Path:
    """A few small source files of other modules, with `tiny_dataset`'s tokenizer and
    seq_len (about 100 samples): the second, smaller source of the mixture tests."""
    from lmforge.data.corpus import stdlib_files
    from lmforge.data.prepare import prepare_dataset
    from lmforge.data.prepare_options import PrepareOptions

    corpus = tmp_path_factory.mktemp("corpus-b")
    small = [f for f in stdlib_files() if "/test" not in f and 2_000 < Path(f).stat().st_size < 5_000]
    for i, path in enumerate(small[7::50][:4]):
        shutil.copy(path, corpus / f"{i:03d}_{Path(path).name}")
    out = tmp_path_factory.mktemp("data") / "second-32"
    prepare_dataset(PrepareOptions(source=str(corpus), out=str(out), seq_len=32, tokenizer=str(tiny_dataset / "tokenizer.json"), show_progress=False))
    return out


@pytest.fixture(scope="session")
def s3_bucket(private_ray_env):
    """s3://<bucket> on a real S3-compatible server (moto), for the session."""
    with s3_server(Path(private_ray_env["root"]) / "s3.log") as bucket:
        yield bucket


@pytest.fixture(scope="session")
def s3_dataset(s3_bucket, tiny_corpus, tiny_dataset) -> str:
    """`tiny_dataset` made again from the corpus copied to the object store, straight
    into it (its tokenizer given): the same shards at an s3:// URI."""
    import fsspec

    from lmforge.data.prepare import prepare_dataset
    from lmforge.data.prepare_options import PrepareOptions

    fsspec.filesystem("s3").put(f"{tiny_corpus}/", f"{s3_bucket}/corpus/", recursive=True)
    out = f"{s3_bucket}/tiny-32"
    prepare_dataset(
        PrepareOptions(
            source=f"{s3_bucket}/corpus", out=out, seq_len=32, tokenizer=str(tiny_dataset / "tokenizer.json"), eval_fraction=0.1, show_progress=False
        )
    )
    return out


@pytest.fixture(scope="session")
def hf_tokenizer(tmp_path_factory) -> Path:
    """A directory with a tokenizer.json and tokenizer_config.json trained here."""
    from hf_models import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("hf-tokenizer"))


@pytest.fixture(scope="session", params=list(LAYOUTS))
def hf_llama(request, tmp_path_factory, hf_tokenizer):
    """(a random LlamaForCausalLM made by transformers, the directory it saved itself
    to with the tokenizer), for each of `hf_models.LAYOUTS`."""
    from hf_models import make_hf_model

    out = tmp_path_factory.mktemp(request.param)
    return make_hf_model(out, request.param, hf_tokenizer), out


def tiny_job(tmp_path: Path, data_path: Path, **sections) -> dict:
    """A 2-rank tiny-model job writing everything under tmp_path."""
    job = {
        "name": "tiny",
        "output_dir": str(tmp_path / "runs"),
        "model": {"preset": "tiny", "vocab_size": 512},
        "parallel": {"dp": 2},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "decay_steps": 8},
        "train": {"global_batch": 8, "micro_batch": 2, "seq_len": 32, "max_steps": 8, "seed": 1},
        "data": {"path": str(data_path), "prefetch_steps": 4},
        "checkpoint": {"interval": 4, "keep": 3},
        # No node sampler: it loads MLflow into a rank (2.5 CPU-seconds a job) to take one
        # sample of a run this short; test_remote_jobs asks for one and checks what it logs.
        "tracking": {"experiment": "tests", "uri": SESSION_MLFLOW, "system_metrics_s": 0},
        "resources": {"cpus_per_worker": 1},
    }
    return with_sections(job, sections)


def with_sections(job: dict, sections: dict) -> dict:
    """`job` with each section's given keys replaced (a non-dict value replaces the section)."""
    for section, values in sections.items():
        if isinstance(values, dict):
            job.setdefault(section, {}).update(values)
        else:
            job[section] = values
    return job


# The end-to-end tests' model (the reference run, so the teacher of every distillation
# test, the model served, quantized and recovered): the tiny shape as Qwen2.5 builds it,
# q/k/v projections with biases, exported as Qwen2ForCausalLM.
QWEN_TINY = {"preset": "tiny", "vocab_size": 512, "family": "qwen2", "qkv_bias": True}
REFERENCE_STEPS = 60  # tiny steps take ~40 ms: enough of them that a fault lands mid-run
REFERENCE_EVAL = {"interval": 3, "batches": 2}  # the held-out loss every 3 steps: a 3-step run has one to compare


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard shows for a run: each scalar's (step, value) as its own reader
    loads the directory (steps retrained after a restart purged, as TensorBoard does)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event
    board.Reload()
    return {tag: [(event.step, event.value) for event in board.Scalars(tag)] for tag in board.Tags()["scalars"]}


def reference_job(tmp_path: Path, data_path: Path, **sections) -> dict:
    """The end-to-end tests' job: the tiny job over 60 steps, a checkpoint every 10,
    the held-out loss every 3, sample ids recorded, two restarts allowed. A run of it with other settings that
    leave the numbers alone (a fault, a resume, a layout, fewer steps) must give
    `reference_run`'s losses."""
    job = tiny_job(
        tmp_path,
        data_path,
        model=dict(QWEN_TINY),
        train={"max_steps": REFERENCE_STEPS},
        optim={"decay_steps": REFERENCE_STEPS},
        checkpoint={"interval": 10},
        data={"path": str(data_path), "prefetch_steps": 4, "record_sample_ids": True},
        fault_tolerance={"max_failures": 2, "backoff_s": 0.1},
        eval=dict(REFERENCE_EVAL),
    )
    return with_sections(job, sections)


@pytest.fixture(scope="session")
def reference_run(ray_session, tiny_dataset, tmp_path_factory) -> dict:
    """The summary of `reference_job` run straight through, once per session."""
    from lmforge import sdk
    from lmforge.spec import spec_from_dict

    return sdk.train(spec_from_dict(reference_job(tmp_path_factory.mktemp("reference"), tiny_dataset)), show_progress=False)


DISTILL_STEPS = 12
DISTILL_TOP_K = 32


def distill_job(tmp_path: Path, data_path: Path, reference_dir: Path, **sections) -> dict:
    """The distillation tests' job: `reference_run`'s last two checkpoints, mixed 3:1,
    teach a smaller student of their family (one block of their two, another seed)
    their top 32 tokens for 12 steps, checkpoint every 4, the held-out KL every 6,
    one restart allowed."""
    teachers = [
        {"path": str(reference_dir / "checkpoints" / f"step_{step:08d}"), "weight": weight}
        for step, weight in ((REFERENCE_STEPS, 3), (REFERENCE_STEPS - 10, 1))
    ]
    job = tiny_job(
        tmp_path,
        data_path,
        name="distill",
        model=QWEN_TINY | {"n_layers": 1},
        train={"max_steps": DISTILL_STEPS, "seed": 2},
        optim={"decay_steps": DISTILL_STEPS},
        eval={"interval": 6, "batches": 2},
        fault_tolerance={"max_failures": 1, "backoff_s": 0.1},
        distill={"teachers": teachers, "loss": "reverse_kl", "ce_weight": 0.5, "temperature": 1.5, "top_k": DISTILL_TOP_K},
    )
    return with_sections(job, sections)


@pytest.fixture(scope="session")
def distill_run(reference_run, tiny_dataset, tmp_path_factory) -> tuple[dict, dict]:
    """(the job, its summary) of `distill_job` run straight through, once per session."""
    from lmforge import sdk
    from lmforge.spec import spec_from_dict

    job = distill_job(tmp_path_factory.mktemp("distill"), tiny_dataset, Path(reference_run.run_dir))
    return job, sdk.train(spec_from_dict(job), show_progress=False)


@pytest.fixture(scope="session")
def distill_cache(reference_run, tiny_dataset, tmp_path_factory) -> tuple[dict, dict]:
    """(the job, the cache's manifest) of `distill_job` with an offline teacher cache,
    built once per session."""
    from lmforge import sdk
    from lmforge.spec import spec_from_dict

    tmp = tmp_path_factory.mktemp("distill-cache")
    job = distill_job(tmp, tiny_dataset, Path(reference_run.run_dir), name="distill-cached", distill={"cache": str(tmp / "cache")})
    return job, sdk.build_cache(spec_from_dict(job), show_progress=False)


INSTRUCT_PROMPTS = 24
INSTRUCT_OPTIM = {"lr": 5e-3, "warmup_steps": 2, "decay_steps": 12}


def write_prompts(path: Path, corpus: Path, count: int = INSTRUCT_PROMPTS) -> Path:
    """A prompts file: the first line of each of the corpus' files, every third as a chat."""
    import json

    lines = [next(line for line in f.read_text().splitlines() if line.strip()).strip()[:16] for f in sorted(corpus.iterdir())]
    with open(path, "w") as out:
        for i in range(count):
            text = lines[i % len(lines)] + f" #{i}"
            # A chat's template costs a dozen tokens here: its content is kept short.
            row = {"messages": [{"role": "user", "content": text[:6]}]} if i % 3 == 2 else {"prompt": text}
            out.write(json.dumps(row) + "\n")
    return path


def instruct_job(tmp_path: Path, reference_dir: Path, prompts: Path, **sections) -> dict:
    """The instruction-distillation tests' job: `reference_run`'s last two checkpoints
    answer 24 prompts (twice each, 10 new tokens, their top 4 kept), a quarter held out,
    into `tmp_path/sft`, which the tiny student then learns for 12 steps (answers and
    soft targets), evaluating every 6."""
    teachers = [{"path": str(reference_dir / "checkpoints" / f"step_{step:08d}")} for step in (REFERENCE_STEPS, REFERENCE_STEPS - 10)]
    instruct = {
        "prompts": str(prompts),
        "eval_fraction": 0.25,
        "prompts_per_shard": 2,
        "generate": {"max_new_tokens": 10, "temperature": 0.7, "n": 2, "seed": 5, "batch_size": 4},
        "select": {"drop_truncated": False, "min_tokens": 3, "min_mean_logprob": -6.0},
    }
    job = tiny_job(
        tmp_path,
        tmp_path / "sft",
        name="instruct",
        train={"max_steps": 12, "seed": 2},
        optim=INSTRUCT_OPTIM,
        data={"path": str(tmp_path / "sft"), "shard_samples": 16, "prefetch_steps": 4},
        eval={"interval": 6, "batches": 1},
        distill={"teachers": teachers, "top_k": 4, "ce_weight": 1.0, "kd_weight": 1.0, "instruct": instruct},
    )
    return with_sections(job, sections)


@pytest.fixture(scope="session")
def instruct_dataset(reference_run, tiny_corpus, ray_session, tmp_path_factory) -> tuple[dict, dict]:
    """(the job, the dataset's manifest) of `instruct_job`'s answers, generated once per session."""
    from lmforge import sdk
    from lmforge.spec import spec_from_dict

    tmp = tmp_path_factory.mktemp("instruct")
    job = instruct_job(tmp, Path(reference_run.run_dir), write_prompts(tmp / "prompts.jsonl", tiny_corpus))
    return job, sdk.generate_answers(spec_from_dict(job), show_progress=False)


MULTINODE_STEPS = 200  # at dp 1 enough steps (~10 s) remain for a node to join and the job to grow
SPARED_STEPS = 60  # the spared run waits for no node: the first steps of the same schedule
MULTINODE_SCRIPT_S = 900  # the scenarios' own bound: the script is killed, with its output in the error
MULTINODE_TIMEOUT_S = MULTINODE_SCRIPT_S + 300  # pytest-timeout of the tests whose setup runs them


MIXTURE_WEIGHTS = (3, 1)  # the elastic scenarios' mixture: tiny_dataset, second_dataset


@pytest.fixture(scope="session")
def multinode(tiny_corpus, tiny_dataset, second_dataset, tmp_path_factory):
    """(each scenario's summary, the runs directory) from tests/multinode_scenarios.py:
    one multi-node cluster for the placement and node-loss tests. The elastic job
    trains on a mixture: a kill and a dp change must keep its order exactly too."""
    from multinode import run_script

    tmp_path = tmp_path_factory.mktemp("multinode")
    placement = tiny_job(tmp_path, tiny_dataset, name="placement", parallel={"dp": 2, "tp": 2}, train={"max_steps": 3}, checkpoint={"interval": 3})
    mixture = [{"path": str(path), "weight": weight} for path, weight in zip((tiny_dataset, second_dataset), MIXTURE_WEIGHTS)]
    elastic = tiny_job(
        tmp_path,
        tiny_dataset,
        train={"max_steps": MULTINODE_STEPS},
        optim={"decay_steps": MULTINODE_STEPS},
        checkpoint={"interval": 10},
        data={"path": None, "sources": mixture, "prefetch_steps": 4, "record_sample_ids": True},
        resources={"cpus_per_worker": 2},
        # A loaded machine may notice a node's death late, so a first restart can land on it and fail too.
        fault_tolerance={"max_failures": 3, "backoff_s": 0.1},
        elastic={"min_dp": 1, "max_dp": 2},
    )
    prepare = {
        "source": str(tiny_corpus),
        "out": str(tmp_path / "prepared"),
        "seq_len": 32,
        "tokenizer": str(tiny_dataset / "tokenizer.json"),
        "eval_fraction": 0.1,
    }
    scenarios = {"prepare": prepare, "placement": placement, "elastic": elastic, "spared_steps": SPARED_STEPS}
    results = run_script(REPO / "tests" / "multinode_scenarios.py", scenarios, tmp_path, timeout_s=MULTINODE_SCRIPT_S)
    return results, tmp_path / "runs"
