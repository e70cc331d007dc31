"""The Python API, from a script or a notebook: prepare a dataset, plan a job, train
it here or submit it to a cluster and follow it, export and generate.

    from lmforge import sdk
    spec = sdk.load("jobs/quickstart.yaml", overrides=["train.max_steps=20"])
    summary = sdk.train(spec)                      # this process drives the job
    job = sdk.submit("jobs/quickstart.yaml", address="http://head:8265")  # the cluster does
    job.follow(); job.plot(); job.summary()
    sdk.generate("runs/quickstart/checkpoints/step_00000200", "def main(", max_new_tokens=32)

A thin face over pre-flight (`lmforge.preflight`), the driver (`lmforge.cluster.driver`)
and job submission (`lmforge.jobs`); the CLI is a thin layer over it.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, TypeVar, Union

from rich.console import Console

from lmforge.checkpoint.export import ExportResult, export_model
from lmforge.cluster import driver
from lmforge.data.manifest import MANIFEST, DatasetManifest, has_manifest, read_manifest
from lmforge.data.precheck import check_before_ray
from lmforge.data.prepare import prepare_dataset
from lmforge.data.prepare_options import PrepareOptions
from lmforge.distill.cache_manifest import CacheManifest, cache_params, tracking_params
from lmforge.distill_jobs import stages
from lmforge.distill_jobs.instruct.build import generate_dataset, plan_generation
from lmforge.distill_jobs.teacher_cache import build_cache as build_teacher_cache
from lmforge.errors import UserError
from lmforge.evaluation.judge import JudgeOptions, run_judge
from lmforge.inference.generate import Generator, default_device
from lmforge.inference.onnx_runtime import OnnxGenerator, export_onnx, is_onnx_model
from lmforge.inference.sampling import SamplingParams
from lmforge.jobs import JobHandle, job, jobs, runs, submit
from lmforge.planner.command import LayoutSearch, MemoryPlan, layout_search, memory_plan
from lmforge.planner.serving import ServingPlan, serving_plan
from lmforge.preflight import check_cache_build, check_teachers, preflight
from lmforge.quantization.command import QuantizeOptions, quantize_model
from lmforge.ray_runtime import embedded_resources, joined
from lmforge.serve.app import check_cpus, check_model, check_port, serve_model, sized_slots
from lmforge.serve.options import Deployment, ServerOptions
from lmforge.spec import JobSpec, load_spec
from lmforge.tracking.mlflow_run import MlflowRun
from lmforge.tracking.model_registry import register_export
from lmforge.tracking.summary import RunSummary

if TYPE_CHECKING:  # lm-eval is an optional extra: the harness module is imported when asked for
    from lmforge.evaluation.harness import HarnessReport

load = load_spec
T = TypeVar("T")

__all__ = [
    "load",
    "prepare",
    "plan",
    "search_layouts",
    "train",
    "submit",
    "JobHandle",
    "job",
    "jobs",
    "runs",
    "export",
    "generate",
    "build_cache",
    "generate_answers",
    "run_pipeline",
    "quantize",
    "serve",
    "judge",
]


def prepare(opts: PrepareOptions, address: Optional[str] = None) -> DatasetManifest:
    """Tokenize and pack a corpus into Parquet shards; returns the manifest."""
    check_before_ray(opts)
    with joined(address):
        return prepare_dataset(opts)


def build_cache(spec: JobSpec, address: Optional[str] = None, show_progress: bool = True) -> CacheManifest:
    """Build a distillation job's offline teacher cache (`distill.cache`): its teachers'
    top-k targets for every sample of its dataset (prepared first if need be); returns
    the cache's manifest."""
    spec = spec.with_absolute_paths()
    check_cache_build(spec)
    data_path = _required(spec.data.path, "data.path", "a teacher cache scores one dataset")
    prepared = has_manifest(data_path)
    check_teachers(spec, read_manifest(data_path) if prepared else None)
    with _distill_stage(spec, "cache", address) as tracker:
        if not prepared:
            prepare_dataset(PrepareOptions.for_job(spec, show_progress=show_progress))
        manifest = build_teacher_cache(spec, show_progress)
        if tracker:
            _track_cache(tracker, spec, manifest)
        return manifest


def generate_answers(spec: JobSpec, address: Optional[str] = None, show_progress: bool = True) -> DatasetManifest:
    """An instruction distillation's dataset (`data.path`): its teachers' answers to
    `distill.instruct.prompts`, selected, as SFT samples with their soft targets;
    returns its manifest. Rerun after an interruption, it answers only what is left."""
    spec = spec.with_absolute_paths()
    plan = plan_generation(spec)  # every refusal before Ray starts
    with _distill_stage(spec, "generate", address) as tracker:
        manifest = generate_dataset(spec, plan, show_progress)
        if tracker:
            _track_generation(tracker, spec, manifest)
        return manifest


def run_pipeline(path, address: Optional[str] = None, show_progress: bool = True) -> stages.PipelineResult:
    """Run a distillation pipeline file's stages in order, each from the previous stage's
    student (`lmforge.distill_jobs.stages`); rerun, it resumes at the stage that stopped."""
    return stages.run_pipeline(path, stages.StageCalls(train, build_cache, generate_answers, evaluate_harness), address, show_progress)


@contextmanager
def _distill_stage(spec: JobSpec, role: str, address: Optional[str]):
    """Ray joined (or started) and, when tracking, the stage's MLflow run as a child of
    the distillation job's; both closed after, the run marked by how the stage ended."""
    with joined(address):
        tracker = MlflowRun(spec, role=role, more_params=lambda: tracking_params(spec)) if spec.tracking.enabled else None
        status = "FAILED"
        try:
            yield tracker
            status = "FINISHED"
        finally:
            if tracker:
                tracker.finish(status)


def _track_generation(tracker, spec: JobSpec, manifest: DatasetManifest) -> None:
    made = _required(manifest.instruct, "data.path", "an instruction dataset was just written")
    settings = made.model_dump(mode="json")
    tracker.log_params({f"distill.instruct.{key}": json.dumps(settings[key]) for key in ("generate", "select", "soft_targets")})
    for key, count in made.counts.model_dump().items():
        if key != "dropped":
            tracker.log_metric(key, count, 0)
    for rule, count in made.counts.dropped.items():
        tracker.log_metric(f"dropped_{rule}", count, 0)
    tracker.log_metric("seconds", manifest.seconds, 0)
    tracker.log_artifact(Path(_required(spec.data.path, "data.path", "answers are one dataset")) / MANIFEST)


def _track_cache(tracker, spec: JobSpec, manifest: CacheManifest) -> None:
    tracker.log_params(cache_params(manifest))  # now that the cache is there: what its manifest says
    sizes = {"bytes_per_token": manifest.bytes_per_token, "dense_bf16_bytes_per_token": manifest.dense_bf16_bytes_per_token, "bytes": manifest.bytes}
    for key, value in (sizes | {"seconds": manifest.seconds}).items():
        tracker.log_metric(key, value, 0)
    # Tokens scored, both splits: each position of each sample once.
    data = manifest.dataset
    tokens = (data.num_samples + data.eval_samples) * data.seq_len
    tracker.log_metric("tokens_per_s", tokens / max(manifest.seconds, 1e-9), 0)
    cache = spec.distill.cache if spec.distill else None
    tracker.log_artifact(Path(_required(cache, "distill.cache", "the cache was just built")) / MANIFEST)


def _required(value: Optional[T], field: str, why: str) -> T:
    """A setting this call cannot do without (the spec's rules normally saw to it)."""
    if not value:
        raise UserError(f"{field}: required here ({why})")
    return value


def plan(spec: JobSpec, cluster: Optional[str] = None, chart: Optional[Union[str, Path]] = None) -> MemoryPlan:
    """`lmforge plan`: the job's largest rank's memory by part (`worst_rank`, bytes), and
    with `cluster` ("nodes=4,gpus_per_node=8,gpu_mem=80GB") whether it `fits`; `chart`:
    a PNG of each pipeline stage's largest rank too. `.show(console)` prints it."""
    return memory_plan(spec, cluster, chart)


def plan_serving(
    spec: JobSpec, sequences: int = 16, context: Optional[int] = None, dtype: str = "fp32", cluster: Optional[str] = None
) -> ServingPlan:
    """`lmforge plan --serve`: a serving replica of the job's model, its weights and the KV
    cache of `sequences` decoding together over `context` positions (default: the model's),
    and with `cluster` how many full-context sequences fit its device."""
    return serving_plan(spec, sequences, context, dtype, cluster)


def search_layouts(spec: JobSpec, cluster: Optional[str] = None, top: int = 5, chart: Optional[Union[str, Path]] = None) -> LayoutSearch:
    """`lmforge plan --search`: the layouts of the job's model and batch that fit `cluster`
    (default: its world size in 8 x 80 GB nodes), fastest first by the step-time model."""
    return layout_search(spec, cluster, top, chart)


def export(checkpoint, out, format: str = "lmforge", dtype: str = "fp32", tokenizer: Optional[str] = None, register: bool = False) -> ExportResult:
    """`lmforge export`: a model directory from a committed checkpoint (`format` "hf":
    one transformers loads); returns what was written. `register` (only when asked: the
    MLflow store a checkpoint names may be another's, or unreachable from here): when
    the checkpoint belongs to an MLflow run, log the directory there and register it as
    a new version of the model named after the job (`registered`: name, version, run_id)."""
    if format == "onnx":
        result = export_onnx(str(checkpoint), str(out), precision=dtype, tokenizer=tokenizer)
    else:
        result = export_model(checkpoint, out, fmt=format, dtype=dtype, tokenizer=tokenizer)
    if register:
        result.registered = register_export(result.source, out, format, result.step)
    return result


def generate(
    model,
    prompts,
    device: Optional[str] = None,
    dtype: str = "fp32",
    tokenizer: Optional[str] = None,
    names: Optional[dict] = None,
    backend: str = "torch",
    **sampling,
) -> list[dict]:
    """Generate from `model`: a path (committed checkpoint, lmforge export, Hugging
    Face directory or quantized directory) or a loaded `lmforge.inference.generate.Generator`
    (load it once with `Generator.load` to generate many times). `prompts`: a string or
    a list of them; `sampling`: the fields of `SamplingParams` (max_new_tokens,
    temperature, top_k, top_p, repetition_penalty, seed, stop), checked before the
    model loads; `names`: how errors name them (`lmforge generate` passes its flags).
    One dict per prompt: text, tokens, logprobs, finish_reason. `backend` "onnxruntime":
    a directory `export(format="onnx")` wrote, run by onnxruntime-genai."""
    unknown = sorted(set(sampling) - set(SamplingParams.__dataclass_fields__))
    if unknown:
        raise UserError(f"generate: unknown option {unknown[0]}; the options are {', '.join(SamplingParams.__dataclass_fields__)}")
    params = SamplingParams(**sampling)
    params.check(names)  # before the model loads
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if backend not in ("torch", "onnxruntime"):
        raise UserError(f"--backend: {backend!r} is not one of torch, onnxruntime")
    if backend == "onnxruntime":
        return [result.as_dict() for result in OnnxGenerator(str(model)).generate(prompts, params)]
    if not isinstance(model, Generator):
        if is_onnx_model(model):
            raise UserError(f"MODEL: {model} is an ONNX Runtime model; pass --backend onnxruntime")
        model = Generator.load(str(model), device or default_device(), dtype, tokenizer)
    return [result.as_dict() for result in model.generate(prompts, params, names)]


def quantize(
    model: str,
    method: str,
    out: str,
    group_size: int = 128,
    eval_data: Optional[str] = None,
    eval_samples: int = 256,
    tokenizer: Optional[str] = None,
    tracking_uri: Optional[str] = None,
    tracking: bool = True,
    say: Callable[[str], None] = print,
) -> dict:
    """`lmforge quantize`: `model`'s blocks quantized (`method` int8, or int4 in groups of
    `group_size`) into the new directory `out`; returns the size and perplexity report
    (perplexity on `eval_samples` of `eval_data`'s held-out split, default the model's
    own dataset)."""
    opts = QuantizeOptions(model, method, out, group_size, eval_data, eval_samples, tokenizer, tracking_uri=tracking_uri, tracking=tracking)
    opts.check()  # before the model loads
    return quantize_model(opts, say=say)


def serve(
    options: ServerOptions,
    host: str = "127.0.0.1",
    port: int = 8000,
    replicas: Union[int, str] = 1,
    max_replicas: int = 4,
    cpus_per_replica: float = 1.0,
    address: Optional[str] = None,
    route_prefix: str = "/",
    app_name: Optional[str] = None,
    say: Callable[[str], None] = print,
    model_as_given: Optional[str] = None,
    grpc_port: Optional[int] = None,
) -> None:
    """`lmforge serve`: the model behind an OpenAI-compatible API on Ray Serve, until
    SIGINT or SIGTERM. `replicas`: a number, or "auto" (1..`max_replicas` on load).
    `model_as_given`: the model path as the user wrote it, for messages. `grpc_port`:
    completions over gRPC there too (lmforge.v1.Completions)."""
    options.check()
    Deployment(host, port, replicas, max_replicas, cpus_per_replica, route_prefix, grpc_port).check()
    if not Path(model_as_given or options.model).exists():
        raise UserError(f"MODEL: {model_as_given or options.model} does not exist")
    check_port(host, port, address)
    if grpc_port:
        if options.long_prompt_tokens is not None:
            raise UserError("--grpc-port: gRPC calls are not routed by length; serve gRPC without --long-prompt-tokens")
        check_port(host, grpc_port, address, flag="--grpc-port")
    embedded = embedded_resources(address)  # what a cluster this call starts would have
    check_cpus(cpus_per_replica, embedded["CPU"] if embedded else None)
    check_model(model_as_given or options.model, options.tokenizer, options.backend, options.adapters)
    if options.memory_per_replica:
        asked, options.max_running = options.max_running, sized_slots(options)
        if options.max_running < asked:
            say(f"--memory-per-replica holds {options.max_running} full-context sequences beside the weights: --max-running {asked} lowered to that")
    serve_model(options, host, port, replicas, cpus_per_replica, address, route_prefix, app_name or options.name, say, max_replicas, grpc_port)


def judge(
    a: str,
    b: str,
    judge: str,
    prompts: str,
    out: str,
    max_tokens: int = 256,
    judge_max_tokens: int = 512,
    concurrency: int = 8,
    keys: Optional[dict[str, Optional[str]]] = None,
    tracking_uri: Optional[str] = None,
    tracking: bool = True,
    say: Callable[[str], None] = print,
) -> dict:
    """`lmforge eval judge`: models `a` and `b` (OpenAI-compatible URLs or model
    directories) answer `prompts` (JSONL), and `judge` compares each pair in both
    orders; writes report.json and judgments.jsonl to `out` and returns the report
    (win, loss, tie and inconsistency rates). `keys`: each endpoint's own API key."""
    opts = JudgeOptions(a, b, judge, prompts, out, max_tokens, judge_max_tokens, concurrency, keys or {}, tracking_uri, tracking)
    return run_judge(opts, say=say)


def evaluate_harness(
    model: str,
    tasks: list[str],
    include_path: Optional[str] = None,
    num_fewshot: Optional[int] = None,
    limit: Optional[float] = None,
    batch_size: int = 8,
    out: Optional[str] = None,
    seed: int = 0,
    tracking: bool = True,
    tracking_uri: Optional[str] = None,
    tp: int = 1,
    pp: int = 1,
    address: Optional[str] = None,
    say: Callable[[str], None] = print,
) -> "HarnessReport":
    """`lmforge eval harness`: lm-evaluation-harness's `tasks` on `model` (a committed
    checkpoint, an export, a Hugging Face or quantized directory) in this process, or
    with `tp` x `pp` > 1 on that many Ray ranks (of the cluster at `address`, else
    RAY_ADDRESS's, else an embedded one), each holding its stage's shard; lm-eval's
    results and samples in `out`, the metrics in MLflow (under a checkpoint's training
    run). Needs lm-eval (`pip install 'lmforge[eval]'`)."""
    if not tasks:
        raise UserError("--tasks: name at least one task")
    if batch_size < 1:
        raise UserError(f"--batch-size: must be at least 1, got {batch_size}")
    for name, value in (("tp", tp), ("pp", pp)):
        if value < 1:
            raise UserError(f"--set parallel.{name}: must be at least 1, got {value}")
    if not Path(model).exists():
        raise UserError(f"MODEL: {model} does not exist")
    try:
        from lmforge.evaluation.harness import HarnessOptions, Layout, run_harness
    except ImportError as err:
        raise UserError(f"lmforge eval harness needs lm-evaluation-harness ({err.name} is missing): pip install 'lmforge[eval]'") from None
    options = HarnessOptions(
        model=model,
        tasks=tasks,
        include_path=include_path,
        num_fewshot=num_fewshot,
        limit=limit,
        batch_size=batch_size,
        out=out,
        seed=seed,
        tracking=tracking,
        tracking_uri=tracking_uri,
        layout=Layout(tp=tp, pp=pp),
        address=address,
    )
    return run_harness(options, say=say)


def train(
    spec: JobSpec, address: Optional[str] = None, show_progress: bool = True, console: Optional[Console] = None, stream_events: bool = False
) -> RunSummary:
    """Run a job to `train.max_steps` (resuming from its latest checkpoint) with this
    process as its driver; returns the summary. `submit` runs it on a cluster instead,
    so that it outlives this process (`stream_events` is how its driver reports back)."""
    return driver.drive(preflight(spec.with_absolute_paths()), address, show_progress, console, stream_events)
