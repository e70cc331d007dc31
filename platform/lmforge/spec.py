"""JobSpec: the typed, validated description of one training job.

A YAML file plus `--set a.b=c` overrides becomes a `JobSpec`; every contradiction
is rejected here (the rules between sections are in `spec_rules.py`), with one line
naming the field, before any cluster work starts.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from lmforge import spec_rules as rules
from lmforge.checkpoint.config import CheckpointSpec
from lmforge.data.config import DataSpec
from lmforge.deepspeed_config import inline_config_file
from lmforge.distill.config import DistillSpec
from lmforge.errors import UserError, first_error
from lmforge.guards.config import DebugSpec, GuardSpec
from lmforge.models.config import PRESETS, ModelConfig
from lmforge.models.lora_config import LoraSpec
from lmforge.models.model_dir import read_model_config
from lmforge.paths import CorpusPath, LocalPath, resolve_paths
from lmforge.section import Section
from lmforge.sizes import parse_size


class ModelSpec(Section):
    preset: str = "tiny"
    dim: Optional[int] = Field(None, gt=0)
    n_layers: Optional[int] = Field(None, gt=0)
    n_heads: Optional[int] = Field(None, gt=0)
    n_kv_heads: Optional[int] = Field(None, gt=0)
    vocab_size: Optional[int] = Field(None, gt=0)
    ffn_hidden: Optional[int] = Field(None, gt=0)
    max_seq_len: Optional[int] = Field(None, gt=0)
    tie_embeddings: Optional[bool] = None
    family: Optional[Literal["llama", "qwen2", "qwen3", "mistral", "gemma3_text", "qwen3_moe"]] = Field(
        None, description="the Hugging Face architecture it exports as"
    )
    head_dim: Optional[int] = Field(None, gt=0, description="each attention head's width (default dim / n_heads)")
    qkv_bias: Optional[bool] = Field(None, description="biases on the q, k and v projections (Qwen2)")
    qk_norm: Optional[bool] = Field(None, description="an RMSNorm over each head's q and k before RoPE (Qwen3)")
    sliding_window: Optional[int] = Field(None, ge=0, description="> 0: attention sees only the last this many positions (0: all)")
    full_attention_layers: Optional[list[int]] = Field(None, description="with a sliding window: the layers that see every position")
    activation: Optional[Literal["silu", "gelu_tanh"]] = Field(None, description="the gated MLP's: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)")
    unit_offset_norms: Optional[bool] = Field(None, description="RMSNorms scale by (1 + w), in fp32 (Gemma)")
    sandwich_norms: Optional[bool] = Field(None, description="a norm after attention and after the MLP too (Gemma)")
    embed_scale: Optional[bool] = Field(None, description="embeddings multiplied by sqrt(dim) (Gemma)")
    query_pre_attn_scalar: Optional[float] = Field(None, ge=0, description="> 0: scores scaled by its -1/2 power, not head_dim's (Gemma)")
    local_rope_theta: Optional[float] = Field(None, ge=0, description="> 0: the sliding layers' RoPE base (Gemma 3)")
    n_experts: Optional[int] = Field(None, ge=0, description="> 0: a mixture of this many experts in each MLP (Qwen3-MoE)")
    experts_per_token: Optional[int] = Field(None, ge=0, description="the experts each token's MLP output sums")
    expert_ffn_hidden: Optional[int] = Field(None, ge=0, description="each expert's hidden width")
    normalize_top_k: Optional[bool] = Field(None, description="the chosen experts' weights renormalized to sum to 1")
    dense_layers: Optional[list[int]] = Field(None, description="with experts: the layers that keep a dense MLP")
    init_from: Optional[LocalPath] = Field(
        None,
        description="start from a model directory (an `lmforge export`, or a Hugging Face Llama); unless resuming. "
        "Without a preset, the model's shape is the directory's",
    )
    lora: Optional[LoraSpec] = Field(None, description="train low-rank adapters on the blocks' linear layers, the model's weights frozen")
    _init_shape: Optional[ModelConfig] = PrivateAttr(None)

    @model_validator(mode="after")
    def _shape_of_init_from(self) -> "ModelSpec":
        if self.init_from and "preset" not in self.model_fields_set:
            try:
                self._init_shape = read_model_config(self.init_from)[1]
            except ValueError as err:
                raise ValueError(f"model.init_from: {err}") from None
        return self

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        if value not in PRESETS:
            raise ValueError(f"unknown preset {value!r}; choose one of {', '.join(PRESETS)}")
        return value

    def resolve(self) -> ModelConfig:
        overrides = self.model_dump(exclude={"preset", "init_from", "lora"})
        return (self._init_shape or PRESETS[self.preset]).with_overrides(**overrides)


class ParallelSpec(Section):
    dp: Union[int, Literal["auto"]] = Field(1, description="data-parallel ranks, or auto: resources.workers / (pp x tp)")
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    # 3: shard params, grads and optimizer state (reshard after forward);
    # 2: keep params gathered between forward and backward; 0: replicate (DDP).
    zero: Literal[0, 2, 3] = 3
    dp_replicate: int = Field(1, ge=1, description="zero 2/3: replicate over this many groups, shard within each (HSDP)")
    cpu_offload: bool = Field(False, description="keep sharded params, grads and optimizer state in CPU memory (FSDP2; GPU ranks)")
    sequence_parallel: bool = Field(True, description="with tp > 1: shard norms and residuals along the sequence")
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    ac_every: Union[Annotated[int, Field(ge=1)], Literal["op"]] = Field(
        2, description="selective: checkpoint every k-th block, or op: every block, keeping matmul and attention outputs"
    )
    compile: bool = Field(False, description="torch.compile each transformer block (with tp > 1: its attention and MLP)")
    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"] = "1f1b"
    virtual_stages: int = Field(1, ge=1, description="pipeline stages per rank (interleaved: >= 2; zero-bubble: 2)")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


class OptimSpec(Section):
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(10, ge=0)
    decay_steps: Optional[int] = Field(None, gt=0, description="cosine horizon; defaults to train.max_steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 disables clipping")


class TrainSpec(Section):
    global_batch: int = Field(16, gt=0, description="samples per optimizer step, over all DP ranks")
    micro_batch: int = Field(4, gt=0, description="samples per forward/backward on one rank")
    seq_len: int = Field(128, description="tokens per sample fed to the model")
    max_steps: int = Field(100, gt=0)
    seed: int = Field(0, ge=0, le=2**63 - 1, description="decides the initial weights and the data order")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="bf16 or fp16 compute (fp16 with dynamic loss scaling), fp32 master weights"
    )

    @field_validator("seq_len")
    @classmethod
    def _positive_seq_len(cls, value: int) -> int:
        if value <= 0:
            raise ValueError(f"must be > 0, got {value}")
        return value


class TrackingSpec(Section):
    enabled: bool = True
    uri: Optional[str] = Field(None, description="MLflow tracking URI; default sqlite:///<output_dir>/mlflow.db")
    experiment: str = "lmforge"
    parent_run_id: Optional[str] = Field(
        None, description="an MLflow run this job's runs nest under (`lmforge distill run` sets it to its pipeline's run)"
    )
    system_metrics_s: float = Field(
        10.0, ge=0, description="how often each node with ranks samples its CPU, memory, disk, network and GPU use into the run (0: never)"
    )
    run_id: Optional[str] = Field(None, description="set by lmforge: the MLflow run the ranks' system metrics and checkpoints belong to")
    tensorboard: Optional[LocalPath] = Field(
        None, description="a directory for TensorBoard (`tensorboard --logdir DIR`): the scalars the MLflow run gets, with or without MLflow"
    )


class ResourcesSpec(Section):
    workers: Optional[int] = Field(None, gt=0, description="worker actors; must equal pp x dp x tp")
    cpus_per_worker: float = Field(1.0, gt=0)
    gpus_per_worker: float = Field(0.0, ge=0)
    memory_per_worker: Optional[Union[int, str]] = Field(
        None, description='device memory of one worker ("24GiB"; on CPU, what a rank may use): a job whose estimate exceeds it is refused'
    )
    replica_label: Optional[str] = Field(
        None,
        min_length=1,
        description="a node label (e.g. a rack or switch): each data-parallel replica is placed on nodes of one value of it, "
        "and replicas fill one value's nodes before the next; nodes without the label are not used",
    )

    @field_validator("memory_per_worker")
    @classmethod
    def _size(cls, value):
        return None if value is None else parse_size(value)


class FaultToleranceSpec(Section):
    max_failures: int = Field(0, ge=0, description="restarts from the latest checkpoint before the job fails")
    backoff_s: float = Field(1.0, ge=0, description="wait before the first restart; doubles with each, up to 60 s")
    step_timeout_s: Optional[float] = Field(
        None, gt=0, description="no step for this long (after an attempt's first step) counts as a hang: a failure"
    )
    spares: int = Field(0, ge=0, description="ranks' worth of capacity held beyond the layout, so a lost rank is replaced without shrinking")
    keep_survivors: bool = Field(
        True,
        description="after a failure, ranks that are done with the attempt keep their processes for the next one (native engine); "
        "false: every rank starts afresh",
    )


class EvalSpec(Section):
    """A held-out loss measured while training; the split is made by `data prepare`."""

    source: Optional[CorpusPath] = Field(None, description="prepare: a separate corpus as the held-out split (instead of data.eval_fraction)")
    interval: Optional[int] = Field(None, gt=0, description="evaluate every N optimizer steps (and at the last step); default checkpoint.interval")
    batches: Optional[int] = Field(
        None, gt=0, description="global batches of held-out samples per evaluation; default all whole batches the split holds"
    )


class ElasticSpec(Section):
    min_dp: int = Field(..., ge=1, description="fewest data-parallel replicas to continue with after a loss")
    max_dp: int = Field(..., ge=1, description="most data-parallel replicas to use when capacity allows")


class DeepSpeedSpec(Section):
    config: Union[str, dict] = Field(..., description="a DeepSpeed config mapping, or a JSON file (relative to the job file)")
    config_file: Optional[str] = Field(None, description="set by lmforge: the file `config` was read from")


class JobSpec(Section):
    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    output_dir: LocalPath = "runs"
    engine: Literal["native", "deepspeed"] = "native"
    deepspeed: Optional[DeepSpeedSpec] = None
    model: ModelSpec = ModelSpec()
    parallel: ParallelSpec = ParallelSpec()
    optim: OptimSpec = OptimSpec()
    train: TrainSpec = TrainSpec()
    data: DataSpec
    checkpoint: CheckpointSpec = CheckpointSpec()
    tracking: TrackingSpec = TrackingSpec()
    resources: ResourcesSpec = ResourcesSpec()
    fault_tolerance: FaultToleranceSpec = FaultToleranceSpec()
    elastic: Optional[ElasticSpec] = None
    eval: Optional[EvalSpec] = None
    distill: Optional[DistillSpec] = None
    guards: GuardSpec = GuardSpec()
    debug: DebugSpec = DebugSpec()

    @model_validator(mode="after")
    def _consistent(self) -> "JobSpec":
        self._resolve_dp()
        rules.check_engine(self)
        model = self.model.resolve()
        rules.check_model(model)
        if self.train.seq_len > model.max_seq_len:
            raise ValueError(f"train.seq_len: {self.train.seq_len} exceeds model.max_seq_len {model.max_seq_len}")
        per_step = self.train.micro_batch * self.parallel.dp
        if self.train.global_batch % per_step:
            raise ValueError(
                f"train.global_batch: {self.train.global_batch} is not divisible by micro_batch x dp = {self.train.micro_batch} x {self.parallel.dp}"
            )
        rules.check_tensor_parallel(self, model)
        rules.check_pipeline(self, model)
        rules.check_sharding(self)
        rules.check_elastic(self)
        rules.check_spares(self)
        rules.check_slow_rank(self)
        rules.check_eval(self)
        rules.check_mixture(self)
        rules.check_distill(self, model)
        rules.check_lora(self, model)
        if self.resources.workers is not None and self.resources.workers != self.parallel.world_size:
            raise ValueError(f"resources.workers: {self.resources.workers} != pp x dp x tp = {self.parallel.world_size}")
        return self

    def _resolve_dp(self) -> None:
        p, workers = self.parallel, self.resources.workers
        if p.dp != "auto":
            if p.dp < 1:
                raise ValueError(f"parallel.dp: must be >= 1 or auto, got {p.dp}")
            return
        if workers is None:
            raise ValueError("parallel.dp: auto needs resources.workers to divide among pp x tp")
        if workers % (p.pp * p.tp):
            raise ValueError(f"parallel.dp: auto cannot split {workers} workers into groups of pp x tp = {p.pp * p.tp}")
        p.dp = workers // (p.pp * p.tp)

    def with_micro_batch(self, micro: int) -> "JobSpec":
        """The same job with another micro-batch (the out-of-memory retry), validated.
        A DeepSpeed config, reconciled at load, pins the old micro-batch and its
        accumulation: both move with it."""
        tree = self.model_dump(mode="json", exclude_unset=True)
        tree["train"] = tree.get("train", {}) | {"micro_batch": micro}
        if self.deepspeed is not None:
            config = tree["deepspeed"]["config"]
            config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"] = micro, "auto"
        return JobSpec.model_validate(tree)

    def with_dp(self, dp: int) -> "JobSpec":
        """The same job on another data-parallel size (elastic resizing), validated."""
        tree = self.model_dump(mode="json", exclude_unset=True)
        tree.get("resources", {}).pop("workers", None)
        return JobSpec.model_validate(tree | {"parallel": tree.get("parallel", {}) | {"dp": dp}})

    def with_changes(self, section: str, **values) -> "JobSpec":
        """The same job with some fields of one section changed, validated."""
        tree = self.model_dump(mode="json", exclude_unset=True)
        return JobSpec.model_validate(tree | {section: tree.get(section, {}) | values})

    # Derived values used across the job; kept here so every module agrees.
    @property
    def model_arch(self) -> ModelConfig:
        return self.model.resolve()

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def grad_accum(self) -> int:
        return self.train.global_batch // (self.train.micro_batch * self.parallel.dp)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.output_dir, self.name)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.run_dir, "checkpoints")

    @property
    def tracking_uri(self) -> str:
        return self.tracking.uri or f"sqlite:///{os.path.abspath(os.path.join(self.output_dir, 'mlflow.db'))}"

    def with_absolute_paths(self) -> "JobSpec":
        """Every path field (typed `LocalPath` or `CorpusPath`) resolved against the
        driver's working directory, so that rank actors (whose working directory may
        differ) see the same files; the checkpoint directory and tracking URI, which
        default to places under the run directory, fixed too."""
        resolved = resolve_paths(self)
        return resolved.model_copy(
            update={
                "checkpoint": resolved.checkpoint.model_copy(update={"dir": resolved.checkpoint_dir}),
                "tracking": resolved.tracking.model_copy(update={"uri": resolved.tracking_uri}),
            }
        )

    @property
    def eval_interval(self) -> Optional[int]:
        """Steps between evaluations (None: no evaluation)."""
        return None if self.eval is None else self.eval.interval or self.checkpoint.interval

    @property
    def decay_steps(self) -> int:
        return self.optim.decay_steps or self.train.max_steps


def apply_override(tree: dict, assignment: str) -> None:
    """Apply one `a.b=c` override; the value is parsed as YAML (numbers, bools, lists)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set {assignment!r}: expected KEY=VALUE, e.g. train.max_steps=10")
    parts = key.strip().split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"--set {key}: {part} is not a section")
        node = child
    node[parts[-1]] = parse_yaml(raw, f"--set {key}") if raw.strip() else raw


def parse_yaml(text: str, where: str) -> Any:
    """`text` as YAML; UserError naming `where` for text that is not, or nests too deeply."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise UserError(f"{where}: not valid YAML ({str(err).splitlines()[0]})") from None
    except RecursionError:
        raise UserError(f"{where}: nested too deeply") from None


def spec_from_dict(tree: dict[str, Any], overrides: list[str] = (), base_dir: str | os.PathLike = ".") -> JobSpec:
    """Validate a job mapping; files it names (a DeepSpeed config) are read relative to
    `base_dir`, before the overrides so that these can reach into them."""
    tree = copy.deepcopy(tree)
    try:
        inline_config_file(tree, base_dir)
        for assignment in overrides:
            apply_override(tree, assignment)
        inline_config_file(tree, ".")  # an override may name another file
        return JobSpec.model_validate(tree)
    except ValidationError as err:
        raise UserError(first_error(err)) from None
    except ValueError as err:
        raise UserError(str(err)) from None


def load_spec(path: str | os.PathLike, overrides: list[str] = ()) -> JobSpec:
    """Read a job file, apply overrides, validate. Raises `UserError` naming the file or field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise UserError(f"{path}: cannot read job file ({err.strerror})") from None
    tree = parse_yaml(text, str(path))
    if not isinstance(tree, dict):
        raise UserError(f"{path}: a job file is a YAML mapping with at least `name` and `data`")
    try:
        return spec_from_dict(tree, overrides, base_dir=path.parent)
    except UserError as err:
        raise UserError(f"{path}: {err}") from None


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """`{'a': {'b': 1}}` -> `{'a.b': 1}`: the spec as MLflow params."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat
