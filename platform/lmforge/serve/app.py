"""`lmforge serve`: the model as a Ray Serve application, one FastAPI ingress per
replica (a fixed number, or Serve's autoscaling on ongoing requests), until the
command is interrupted; then the application is deleted and an embedded Ray stops.

Several `lmforge serve` commands may share one cluster, each under its own
application name and route prefix (Serve has one HTTP port per cluster, and one gRPC
port, where a call names its application in its `application` metadata).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Optional, Union

from ray import serve
from ray.serve.handle import DeploymentHandle

from lmforge.checkpoint.export import open_source
from lmforge.errors import UserError
from lmforge.inference.onnx_runtime import check_onnx_model, is_onnx_model
from lmforge.memory.serving import serving_memory, size_slots
from lmforge.models.peft_format import read_peft_dir
from lmforge.models.quantized import QUANTIZATION, is_quantized
from lmforge.ray_runtime import connect, embedded_resources
from lmforge.serve.api import build_api, json_body, server_sent_events
from lmforge.serve.backend import Backend
from lmforge.serve.grpc_api import SERVICER, GrpcCompletions
from lmforge.serve.options import ServerOptions
from lmforge.serve.protocol import APIError, ChatRequest, CompletionRequest, parse
from lmforge.serve.routing import PromptLength, build_router_api

REPLICA_DTYPE = "fp32"  # what a replica loads a model in (Generator.load's default)


class ModelReplica:
    """A replica's model and what reaches it without HTTP: gRPC, and the length router."""

    def __init__(self, options: ServerOptions):
        self.backend = Backend(options)
        self.grpc = GrpcCompletions(self.backend)

    # gRPC methods, called by name by Serve's gRPC proxy (lmforge.v1.Completions).
    async def Complete(self, request, grpc_context):
        return await self.grpc.complete(request, grpc_context)

    async def CompleteStream(self, request, grpc_context):
        async for chunk in self.grpc.complete_stream(request, grpc_context):
            yield chunk

    # Called by the length router's ingress (serve/routing.py) with a checked body.
    async def relay(self, kind: str, data: bytes):
        """("json", status, body) or ("stream", 200, None) then the stream's events."""
        try:
            request = parse(CompletionRequest if kind == "completion" else ChatRequest, json_body(data))
            answer = await self.backend.answer(kind, request)
        except APIError as err:
            self.backend.metrics.error(err.status)
            yield ("json", err.status, err.body())
            return
        if isinstance(answer, dict):
            yield ("json", 200, answer)
            return
        yield ("stream", 200, None)
        async for text in server_sent_events(answer):
            yield text

    def model_cards(self) -> list[dict]:
        return self.backend.model_cards()


@serve.ingress()
class ModelServer(ModelReplica):
    """A replica that is the application's HTTP ingress."""

    def __serve_build_asgi_app__(self):
        return build_api(self.backend)


@serve.ingress()
class LengthRouter:
    def __init__(self, options: ServerOptions, short: DeploymentHandle, long: DeploymentHandle):
        assert options.long_prompt_tokens is not None
        self.options, self.pools = options, {"short": short, "long": long}
        self.length = PromptLength(options, options.long_prompt_tokens)

    def __serve_build_asgi_app__(self):
        return build_router_api(self.options, self.length, self.pools)


def application(options: ServerOptions, replicas: Union[int, str], cpus: float, gpus: float, max_replicas: int = 4):
    """The bound Serve application: the model's replicas, or with `long_prompt_tokens`
    a length router before two pools of them (`long_replicas` take the long prompts)."""
    config = {
        # Serve's own cap on requests a replica holds: above the engine's, which queues;
        # beyond it Serve would queue without bound at its proxy: a bounded queue, then 503.
        "max_ongoing_requests": options.max_running + options.max_waiting,
        "max_queued_requests": max(1, options.max_waiting),
        "ray_actor_options": {"num_cpus": cpus, "num_gpus": gpus, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(options.threads)}}},
        "health_check_period_s": 5,
    }
    if replicas == "auto":
        config["autoscaling_config"] = {"min_replicas": 1, "max_replicas": max_replicas, "target_ongoing_requests": options.max_running}
    else:
        config["num_replicas"] = replicas
    if options.long_prompt_tokens is None:
        return serve.deployment(ModelServer, name="ModelServer").options(**config).bind(options)
    short = serve.deployment(ModelReplica, name="ShortPrompts").options(**config).bind(options)
    long_config = {k: v for k, v in config.items() if k != "autoscaling_config"} | {"num_replicas": options.long_replicas}
    long = serve.deployment(ModelReplica, name="LongPrompts").options(**long_config).bind(options)
    return serve.deployment(LengthRouter, name="LengthRouter").options(ray_actor_options={"num_cpus": 0}).bind(options, short, long)


def check_model(path: str, tokenizer: Optional[str], backend: str = "torch", adapters: Optional[dict[str, str]] = None) -> None:
    """Before anything starts: the model opens (headers only) and has a tokenizer; an
    ONNX Runtime model directory goes with `--backend onnxruntime`, and only it; each
    adapter is a LoRA of this model's shape."""
    if backend == "onnxruntime":
        check_onnx_model(path)
        return
    if is_onnx_model(path):
        raise UserError(f"MODEL: {path} is an ONNX Runtime model; serve it with --backend onnxruntime")
    if is_quantized(path):
        if adapters:
            raise UserError("--adapter: adapters are served on a full-precision model; serve the model before `lmforge quantize`")
        if not (Path(path) / "config.json").is_file() or not (tokenizer or (Path(path) / "tokenizer.json").is_file()):
            raise UserError(f"MODEL: {path} has {QUANTIZATION} but lacks config.json or tokenizer.json")
        return
    source = open_source(path, tokenizer)
    if source.tokenizer_json is None:
        raise UserError(f"MODEL: {path} has no tokenizer to turn prompts into tokens; pass --tokenizer tokenizer.json")
    for name, adapter in (adapters or {}).items():
        try:
            read_peft_dir(adapter, source.cfg)
        except ValueError as err:
            raise UserError(f"--adapter {name}: {err}") from None


def sized_slots(options: ServerOptions) -> int:
    """The slots (`--max-running`, at most) a replica of `--memory-per-replica` holds beside
    the weights, each for a full-context sequence; refused where not even one fits."""
    if options.backend == "onnxruntime" or is_quantized(options.model):
        what = "an ONNX Runtime model" if options.backend == "onnxruntime" else "a quantized model"
        raise UserError(f"--memory-per-replica: sizes the slots of lmforge's full-precision replicas, not {what}'s")
    source = open_source(options.model, options.tokenizer)
    plan = serving_memory(source.cfg, REPLICA_DTYPE, options.max_running)
    return size_slots(plan, options.memory_per_replica or 0, "--memory-per-replica")


def serve_model(
    options: ServerOptions,
    host: str,
    port: int,
    replicas: Union[int, str],
    cpus: float,
    address: Optional[str],
    route_prefix: str,
    app_name: str,
    say=print,
    max_replicas: int = 4,
    grpc_port: Optional[int] = None,
) -> None:
    """Deploy, say where, and keep serving until SIGINT or SIGTERM. `max_replicas`: the
    autoscaler's bound when `replicas` is "auto"; `grpc_port`: gRPC there too."""
    import dataclasses
    import logging

    import ray

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the command says where it serves
    started_ray = connect(address)
    try:
        largest = max((node["Resources"].get("CPU", 0.0) for node in ray.nodes() if node["Alive"]), default=0.0)
        check_cpus(cpus, largest)
        if options.device is None:  # replicas run where the cluster's accelerators are (an ONNX export's build: the CPU)
            gpus_there = ray.cluster_resources().get("GPU", 0) > 0 and options.backend == "torch"
            options = dataclasses.replace(options, device="cuda" if gpus_there else "cpu")
        gpus = 1.0 if options.device == "cuda" else 0.0
        grpc_options = {"port": grpc_port, "grpc_servicer_functions": [SERVICER]} if grpc_port else None
        serve.start(http_options={"host": host, "port": port}, grpc_options=grpc_options)  # joins a running Serve as it is
        bound = _http_port()
        if bound != port:
            raise UserError(f"--port: Serve on this cluster already listens on port {bound}; pass --port {bound}")
        if grpc_port:
            check_grpc(grpc_port)
        try:  # returns once the replicas are up
            serve.run(application(options, replicas, cpus, gpus, max_replicas), name=app_name, route_prefix=route_prefix, blocking=False)
        except RuntimeError as err:  # a replica failed to start: its last line says why
            last = [line for line in str(err).splitlines() if line.strip()][-1:] or ["(no message)"]
            raise UserError(f"MODEL: {options.model}: the server's replica failed to start: {last[0].strip()}") from None
        base = f"http://{host}:{port}{route_prefix.rstrip('/')}"
        grpc_at = f" and gRPC at {host}:{grpc_port} (application {app_name})" if grpc_port else ""
        say(
            f"serving {options.name} ({options.batching} batching, up to {options.max_running} sequences per replica, "
            f"{options.device}) at {base}/v1{grpc_at}{' (API key required)' if options.api_key_sha256 else ''}; Ctrl-C stops"
        )
        _wait_for_signal()
    finally:
        try:
            serve.delete(app_name)
        except Exception:  # noqa: BLE001 - the cluster may be going away already
            pass
        if started_ray:
            serve.shutdown()
            ray.shutdown()


def check_cpus(cpus: float, largest: Optional[float]) -> None:
    """A replica must fit one node (`largest`: its CPUs, None when not known yet), or
    Serve would wait for it forever."""
    if largest is not None and cpus > largest:
        raise UserError(f"--cpus-per-replica: {cpus:g}, but the largest node of the cluster has {largest:g} CPUs")


def check_port(host: str, port: int, address: Optional[str], flag: str = "--port") -> None:
    """A cluster this command starts will bind the port for Serve: it must be free."""
    import socket

    if embedded_resources(address) is None:
        return  # joining a cluster, whose Serve may listen there already
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError as err:
            raise UserError(f"{flag}: {host}:{port} is in use ({err.strerror}); pass another {flag}") from None


def check_grpc(port: int) -> None:
    """Serve on this cluster speaks lmforge's gRPC on `port` (a Serve started earlier
    keeps its own gRPC settings)."""
    import ray
    from ray.serve.context import _get_global_client

    config = ray.get(_get_global_client()._controller.get_grpc_config.remote())
    if SERVICER not in config.grpc_servicer_functions or config.port != port:
        have = f"gRPC on port {config.port}" if SERVICER in config.grpc_servicer_functions else "no lmforge gRPC"
        raise UserError(f"--grpc-port: Serve on this cluster was started with {have}; restart Serve, or pass its port")


def _http_port() -> Optional[int]:
    """The port Serve's proxies listen on (set by whoever started Serve on the cluster)."""
    from ray.serve.context import _get_global_client

    return _get_global_client().http_config.port


def _wait_for_signal() -> None:
    """Until SIGINT or SIGTERM (handled here: a shell starts background jobs with SIGINT ignored)."""
    stop: list[int] = []
    previous = {sig: signal.signal(sig, lambda number, _: stop.append(number)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop:
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
