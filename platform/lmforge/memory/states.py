"""Model-state bytes on one rank: parameters, gradients and optimizer states.

Native engine: counted from the real parameter shapes (the model built on the meta
device and cut into the rank's pipeline stages by the engine's own rule), each
split as the engine splits it: tensor parallelism per `parallel.tensor.shard_dim`,
then FSDP2 along dim 0 of the TP-local tensor over `dp_shard` ranks (torch.chunk
sizes: ceil(n / k) rows, the last ranks fewer or none). Weights, gradients and
AdamW's two moments are fp32 (FSDP2 keeps fp32 shards and reduces in fp32 under
bf16); AdamW adds a 4-byte `step` tensor per parameter. A distillation job adds
its hidden-state adapters to the trained parameters (replicated over TP, FSDP-split
like the rest) and its frozen teachers' fp32 weights, split as the student's are. With
`model.lora` only the low-rank factors (and those adapters) have gradients and moments.

DeepSpeed engine: the ZeRO paper's accounting (Rajbhandari et al. 2020, section 3:
2 + 2 + K bytes per parameter for mixed-precision Adam, K = 12), split the way
DeepSpeed's own estimators split it (`estimate_zero2_model_states_mem_needs`,
`estimate_zero3_model_states_mem_needs`): 16-bit weights, fp32 gradients and the
fp32 master copy with both moments partitioned by stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from lmforge.distill.hidden import ADAPTERS
from lmforge.models.llama import Transformer
from lmforge.models.lora_config import LoraSpec, adapter_shapes, nf4_bytes, quantized_weights
from lmforge.parallel.fsdp import needs_wrapping
from lmforge.parallel.pipeline import in_stage, split_layers, stage_indices
from lmforge.parallel.shape import MeshShape
from lmforge.parallel.tensor import shard_dim

if TYPE_CHECKING:
    from lmforge.models.config import ModelConfig
    from lmforge.spec import JobSpec

FP32 = 4


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int
    host: int = 0  # offloaded to CPU memory instead (not in the three above)
    disk: int = 0  # offloaded to NVMe (DeepSpeed's ZeRO-Infinity): on disk, neither device nor host
    largest_unit: int = 0  # unsharded parameters of the biggest FSDP/ZeRO-3 unit (a block)
    teacher: int = 0  # a distillation's frozen teachers' weights (no gradients, no optimizer state)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.teacher


def chunk_size(n: int, parts: int, index: int) -> int:
    """Rows of `n` that part `index` of `parts` holds, as torch.chunk (and DTensor
    Shard, and FSDP2) split them."""
    step = math.ceil(n / parts)
    return max(0, min(step, n - index * step))


def local_numel(name: str, shape: tuple[int, ...], tp: int, tp_rank: int, dp_shard: int, dp_shard_rank: int) -> int:
    """Elements of a parameter on one rank after TP and then FSDP2 sharding."""
    local = list(shape)
    dim = shard_dim(name) if tp > 1 else None
    if dim is not None:
        local[dim] = chunk_size(local[dim], tp, tp_rank)
    if local:
        local[0] = chunk_size(local[0], dp_shard, dp_shard_rank)
    return math.prod(local)


@lru_cache(maxsize=16)
def model_parameters(cfg: ModelConfig) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
    """(name, identity, shape) of every parameter name of the model built on the meta
    device; a tied weight appears under each of its names with one identity."""
    with torch.device("meta"):
        whole = Transformer(cfg)
    identity: dict[int, int] = {}
    return tuple(
        (name, identity.setdefault(id(param), len(identity)), tuple(param.shape)) for name, param in whole.named_parameters(remove_duplicate=False)
    )


@lru_cache(maxsize=512)
def stage_parameters(cfg: ModelConfig, seq_len: int, pp: int, virtual: int, schedule: str, pp_rank: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of each distinct parameter of the stages `pp_rank` runs, kept as
    the engine's `cut_stage` keeps them (FLOP-balanced ranges, embedding first, head
    last): a tied weight counts once, under the first name its stages give it."""
    if pp == 1:
        stages = [(range(cfg.n_layers), True, True)]
    else:
        ranges, last = split_layers(cfg, seq_len, pp * virtual), pp * virtual - 1
        stages = [(ranges[i], i == 0, i == last) for i in stage_indices(pp_rank, pp, virtual, schedule)]
    seen, params = set(), []
    for layers, first, last in stages:
        for name, identity, shape in model_parameters(cfg):
            if identity not in seen and in_stage(_part(name), layers, first, last):
                seen.add(identity)
                params.append((name, shape))
    return tuple(params)


def _part(name: str) -> str:
    """The top-level part a parameter belongs to: "layers.3.attention.wq.weight" -> "layers.3"."""
    head, _, rest = name.partition(".")
    return f"{head}.{rest.partition('.')[0]}" if head == "layers" else head


def adapter_parameters(spec: JobSpec, teachers: tuple[ModelConfig, ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of a distillation's hidden-state adapters (student width to the teacher's)."""
    hidden = spec.distill.hidden if spec.distill else None
    if hidden is None:
        return ()
    return tuple((f"{ADAPTERS}.adapters.{layer}.weight", (teachers[0].dim, spec.model_arch.dim)) for layer in hidden.layers)


def native_states(spec: JobSpec, rank: int, teachers: tuple[ModelConfig, ...] = ()) -> StateBytes:
    """Bytes of the model states of global `rank` under the native engine; `teachers`:
    a distillation's teacher shapes, in `distill.sources` order."""
    p = spec.parallel
    shape = MeshShape.for_spec(p)
    coords = shape.coordinates(rank)
    shard_rank = coords["dp"] % shape.dp_shard
    params = stage_parameters(spec.model_arch, spec.train.seq_len, p.pp, p.virtual_stages, p.schedule, coords["pp"])
    beside = adapter_parameters(spec, teachers)
    lora = spec.model.lora
    low_rank = tuple(adapter_shapes(dict(params), lora).items()) if lora else ()
    trained = (*low_rank, *beside) if lora else (*params, *beside)  # LoRA: the base is frozen (no gradient, no moments)
    # QLoRA: the adapted layers' weights in NF4, counted by what torchao's tensor holds.
    in_nf4 = quantized_weights(dict(low_rank), lora)
    nf4 = sum(nf4_bytes(math.prod(dims), shape.dp_shard) for name, dims in params if name in in_nf4)
    params = (*(item for item in params if item[0] not in in_nf4), *low_rank, *beside)
    numel = _rank_numel(params, p.tp, coords["tp"], shape.dp_shard, shard_rank)
    grad_numel = trained_numel = _rank_numel(trained, p.tp, coords["tp"], shape.dp_shard, shard_rank)
    if p.tp > 1 and not needs_wrapping(shape, spec.train.precision, p.cpu_offload):
        # Measured (torch 2.13): without FSDP to reduce-scatter it, the vocabulary-split
        # embedding's gradient comes back whole (Replicate) on every TP rank.
        grad_numel += sum(
            math.prod(dims) - local_numel(name, dims, p.tp, coords["tp"], 1, 0) for name, dims in trained if name == "tok_embeddings.weight"
        )
    weights, grads = numel * FP32 + nf4, grad_numel * FP32
    optimizer = 2 * trained_numel * FP32 + len(trained) * FP32  # exp_avg, exp_avg_sq, and a step scalar each
    unit = _largest_block_numel(params, p.tp, coords["tp"])
    frozen = (
        sum(
            _rank_numel(stage_parameters(t, spec.train.seq_len, 1, 1, p.schedule, 0), p.tp, coords["tp"], shape.dp_shard, shard_rank)
            for t in teachers
        )
        * FP32
    )
    state = StateBytes(weights, grads, optimizer, largest_unit=unit * (2 if spec.train.precision in ("bf16", "fp16") else FP32), teacher=frozen)
    if p.cpu_offload:
        return StateBytes(0, 0, 0, host=state.total, largest_unit=state.largest_unit)
    return state


def lora_parameters(cfg: ModelConfig, lora: LoraSpec) -> int:
    """Elements of a LoRA job's adapters: all it trains."""
    shapes = {name: shape for name, _, shape in model_parameters(cfg)}
    return sum(math.prod(shape) for shape in adapter_shapes(shapes, lora).values())


def deepspeed_states(
    cfg: ModelConfig,
    dp: int,
    precision: str,
    stage: int,
    offload_optimizer: str = "none",
    offload_params: str = "none",
    lora: LoraSpec | None = None,
) -> StateBytes:
    """Bytes per rank under DeepSpeed ZeRO `stage` (1, 2 or 3) over `dp` ranks; with
    `lora`, gradients and optimizer states are the adapters' alone. The offloads name
    a device as DeepSpeed's config does ("cpu", "nvme", "none"): offloaded to NVMe,
    the optimizer states (or the parameters) are on disk, the fp32 gradients still
    in host memory."""
    n, psi = dp, cfg.num_params()
    trained = psi if lora is None else lora_parameters(cfg, lora)
    psi += 0 if lora is None else trained
    half = 2 if precision in ("bf16", "fp16") else FP32
    params = half * psi if stage < 3 else _share(half * psi, n)
    grads16 = half * trained if stage == 1 else (_share(half * trained, n) if stage == 2 else 0)
    grads32 = _share(FP32 * trained, n)  # the fp32 gradient partition
    optimizer = _share(3 * FP32 * trained, n)  # fp32 master weights, exp_avg, exp_avg_sq
    largest = 2 * half * largest_module_params(cfg) if stage == 3 else 0  # its gathered 16-bit weights and grads
    params_at = offload_params if stage == 3 else "none"
    if params_at == "none" and offload_optimizer == "none":
        return StateBytes(params, grads16 + grads32, optimizer, largest_unit=largest)
    placed = {"none": 0, "cpu": grads32, "nvme": 0}
    placed[offload_optimizer if offload_optimizer != "none" else "cpu"] += optimizer
    placed[params_at] += params
    return StateBytes(placed["none"], 0, 0, host=placed["cpu"], disk=placed["nvme"], largest_unit=largest)


def _share(total: int, parts: int) -> int:
    return int(total / parts)  # DeepSpeed's estimators truncate the same way


# Cached: a planner search asks for the same stages' sums under hundreds of layouts.
@lru_cache(maxsize=4096)
def _rank_numel(params, tp: int, tp_rank: int, dp_shard: int, shard_rank: int) -> int:
    return sum(local_numel(name, dims, tp, tp_rank, dp_shard, shard_rank) for name, dims in params)


@lru_cache(maxsize=1024)
def _largest_block_numel(params, tp: int, tp_rank: int) -> int:
    """The largest block's parameters gathered over FSDP (still split by TP): what one
    FSDP unit holds unsharded during its forward and backward."""
    blocks: dict[str, int] = {}
    for name, dims in params:
        if name.startswith("layers."):
            block = name.split(".")[1]
            blocks[block] = blocks.get(block, 0) + local_numel(name, dims, tp, tp_rank, 1, 0)
    return max(blocks.values(), default=0)


@lru_cache(maxsize=16)
def largest_module_params(cfg: ModelConfig) -> int:
    """Parameters of the largest single module (its own, not its children's): the
    unit DeepSpeed ZeRO-3 gathers whole (its estimator's `largest_layer_params`)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
