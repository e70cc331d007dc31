"""What `lmforge serve` and `sdk.serve` are asked for, and its checks: each bad value
one line naming the flag, before Ray or the model loads. No torch here: the CLI
builds the options when a command is parsed."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from lmforge.errors import UserError

MODES = ("continuous", "request", "off")  # how requests share the model (serve/engine.py)
BACKENDS = ("torch", "onnxruntime")  # lmforge's own model, or a model directory ONNX Runtime runs


@dataclass
class ServerOptions:
    model: str  # a model directory, quantized directory or committed checkpoint
    name: str  # what clients call it (`model` in requests)
    batching: str = "continuous"  # continuous | request | off
    max_running: int = 16  # sequences decoding together
    max_waiting: int = 256  # sequences queued for a slot; more are refused (503)
    max_n: int = 8
    max_logprobs: int = 20  # top alternatives per token a request may ask for (vLLM's default; a served teacher's top-k wants more)
    prefix_reuse: bool = True  # a prompt's beginning that a slot holds is copied, not computed again
    long_prompt_tokens: Optional[int] = None  # prompts this long go to replicas of their own (None: no routing)
    long_replicas: int = 1  # ... this many
    cache_size: int = 256  # responses kept for identical temperature-0 requests (0: none) ...
    cache_bytes: int = 64 << 20  # ... and at most this much of their JSON
    max_body_bytes: int = 8 << 20  # a request body larger is refused (413) before it is read whole
    api_key_sha256: Optional[str] = None  # the key's digest: the key itself never enters Serve's config
    device: Optional[str] = None  # cpu or cuda; None: decided when the cluster is known
    tokenizer: Optional[str] = None
    chat_template: Optional[str] = None  # a Jinja file; default: the model's tokenizer_config.json, else lmforge's
    threads: int = 1
    backend: str = "torch"  # one of BACKENDS
    stream_interval: int = 1  # a stream's chunk holds this many new tokens per running choice (the first: at once)
    adapters: dict[str, str] = field(default_factory=dict)  # name in requests -> a PEFT LoRA directory on this model
    memory_per_replica: Optional[int] = None  # bytes a replica may hold: its slots are sized to fit beside the weights

    def check(self) -> None:
        if self.batching not in MODES:
            raise UserError(f"--batching: {self.batching!r} is not one of {', '.join(MODES)}")
        if self.backend not in BACKENDS:
            raise UserError(f"--backend: {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.backend == "onnxruntime":
            self._check_onnx()
        for flag in ("max_running", "max_waiting", "max_n", "max_logprobs", "threads", "long_replicas", "stream_interval"):
            _at_least_one(flag, getattr(self, flag))
        if self.long_prompt_tokens is not None:
            _at_least_one("long_prompt_tokens", self.long_prompt_tokens)
        if self.cache_size < 0:
            raise UserError(f"--cache-size: must be >= 0, got {self.cache_size}")
        if self.chat_template and not Path(self.chat_template).is_file():
            raise UserError(f"--chat-template: {self.chat_template} does not exist")
        if self.adapters:
            self._check_adapters()

    def _check_adapters(self) -> None:
        if self.name in self.adapters:
            raise UserError(f"--adapter: {self.name} is the base model's name; give the adapter another")
        if self.backend == "onnxruntime" or self.batching == "request":
            flag = "--backend onnxruntime" if self.backend == "onnxruntime" else "--batching request"
            raise UserError(f"--adapter: adapters join lmforge's continuous batch; they are not served with {flag}")
        for name, path in self.adapters.items():
            if not (Path(path) / "adapter_config.json").is_file():
                raise UserError(f"--adapter {name}: {path} is not a PEFT adapter directory (no adapter_config.json)")

    def _check_onnx(self) -> None:
        """What the ONNX Runtime engine does not do (it runs each sequence on its own
        generator, on the CPU build the export made)."""
        if self.batching == "request":
            raise UserError("--batching: request-level batching is the torch backend's; with --backend onnxruntime use continuous or off")
        if self.device not in (None, "cpu"):
            raise UserError(f"--device: {self.device} is not the CPU that lmforge's ONNX exports are built for (--backend onnxruntime)")
        if self.tokenizer:
            raise UserError("--tokenizer: an ONNX Runtime model directory serves the tokenizer.json it was exported with")


@dataclass(frozen=True)
class Deployment:
    """Where and how many: the Serve application's replicas, port and route."""

    host: str = "127.0.0.1"
    port: int = 8000
    replicas: Union[int, str] = 1  # a number, or "auto" (1..max_replicas on load)
    max_replicas: int = 4
    cpus_per_replica: float = 1.0
    route_prefix: str = "/"
    grpc_port: Optional[int] = None  # gRPC there too; None: HTTP only

    def check(self) -> None:
        if self.replicas != "auto" and not (isinstance(self.replicas, int) and self.replicas >= 1):
            raise UserError(f"--replicas: a number of at least 1 or auto, got {self.replicas!r}")
        for flag in ("max_replicas", "port"):
            _at_least_one(flag, getattr(self, flag))
        if self.grpc_port is not None:
            _at_least_one("grpc_port", self.grpc_port)
        for flag, port in (("port", self.port), ("grpc-port", self.grpc_port)):
            if port is not None and port > 65535:
                raise UserError(f"--{flag}: must be at most 65535, got {port}")
        if self.grpc_port == self.port:
            raise UserError(f"--grpc-port: {self.grpc_port} is the HTTP port too; give gRPC another")
        if not self.cpus_per_replica > 0:
            raise UserError(f"--cpus-per-replica: must be > 0, got {self.cpus_per_replica}")
        if self.route_prefix != "/" and (self.route_prefix.endswith("/") or "{" in self.route_prefix or "}" in self.route_prefix):
            raise UserError(f"--route-prefix: a path like /name, not ending in / and without braces, got {self.route_prefix!r}")
        if not self.route_prefix.startswith("/"):
            raise UserError(f"--route-prefix: must start with /, got {self.route_prefix!r}")


def key_digest(key: str) -> str:
    """An API key as Serve's config keeps it: its sha256, never the key."""
    return hashlib.sha256(key.encode()).hexdigest()


def _at_least_one(flag: str, value: int) -> None:
    if value < 1:
        raise UserError(f"--{flag.replace('_', '-')}: must be at least 1, got {value}")
