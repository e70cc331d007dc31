"""The per-rank memory breakdown of a job, before launch: model states
(`memory.states`), activations of the micro-batches a pipeline schedule keeps in
flight (`memory.activations`), and the largest temporary buffers.

In flight per rank (pp stages, m micro-batches, rank r): 1 without a pipeline;
GPipe m; 1F1B min(m, pp - r) (Narayanan et al. 2021, section 2.2); interleaved
1F1B min(v m, (v - 1) pp + 2 (pp - 1 - r) + 1) chunks of one virtual stage each,
the warm-up of Megatron's and torch.distributed.pipelining's schedule; zero-bubble
(ZBV) is counted as interleaved with v = 2, an upper bound.

Temporary: the last stage's logits and fp32 log-softmax for one micro-batch; with
FSDP2 ZeRO-3 two blocks gathered (the one computing, the one prefetched) plus one
block's unsharded fp32 gradients; ZeRO-2 keeps every block gathered from forward
to backward; DeepSpeed ZeRO-3 its largest module's 16-bit weights and grads.
A distillation adds its frozen teachers' weights (`teacher`) and, temporarily, each
teacher's logits for one micro-batch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from lmforge.distill.teacher import teacher_shapes
from lmforge.memory import activations as act
from lmforge.memory.states import FP32, StateBytes, deepspeed_states, native_states
from lmforge.parallel.fsdp import needs_wrapping
from lmforge.parallel.pipeline import split_layers, stage_indices
from lmforge.parallel.shape import MeshShape

if TYPE_CHECKING:
    from lmforge.spec import JobSpec


@dataclass(frozen=True)
class Breakdown:
    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    temporary: int
    host: int  # offloaded to CPU memory
    teacher: int = 0  # a distillation's frozen teachers' weights
    disk: int = 0  # offloaded to NVMe

    @property
    def device_total(self) -> int:
        return self.params + self.grads + self.optimizer + self.teacher + self.activations + self.temporary

    def as_dict(self) -> dict:
        return asdict(self) | {"device_total": self.device_total}


def estimate(spec: JobSpec, rank: int) -> Breakdown:
    """What global `rank` holds at its peak (every term at once: an upper bound)."""
    p = spec.parallel
    coords = MeshShape.for_spec(p).coordinates(rank)
    teachers = teacher_shapes(spec.distill)
    states = _states(spec, rank, teachers)
    stages = _stages(spec, coords["pp"])
    shape = act.Shape(
        spec.train.micro_batch, spec.train.seq_len, p.tp, p.sequence_parallel and p.tp > 1, 2 if spec.train.precision != "fp32" else FP32
    )
    cfg = spec.model_arch
    per_stage = [act.stage_bytes(cfg, shape, layers, first, last, p.activation_checkpointing, p.ac_every) for layers, first, last in stages]
    chunks = in_flight(p.schedule, p.pp, p.virtual_stages, spec.grad_accum, coords["pp"])
    activations = round(chunks * sum(per_stage) / len(per_stage)) if p.pp > 1 and len(per_stage) > 1 else chunks * sum(per_stage)
    last = any(last for _, _, last in stages)
    temporary = (act.logits_bytes(cfg, shape) if last else 0) + _gathered(spec, states, sum(blocks for blocks, _, _ in stages))
    temporary += sum(act.teacher_logits_bytes(t, shape) for t in teachers)
    return Breakdown(rank, states.params, states.grads, states.optimizer, activations, temporary, states.host, states.teacher, states.disk)


def worst_rank(spec: JobSpec) -> Breakdown:
    """The rank with the most device memory: the one that decides whether a job fits.
    Only the pipeline stages differ much; within one, the first TP and DP rank holds
    the most (torch.chunk gives the first parts the rounded-up share)."""
    return max(stage_peaks(spec), key=lambda b: b.device_total)


def stage_peaks(spec: JobSpec) -> list[Breakdown]:
    """The largest rank of each pipeline stage (tp and dp coordinates 0)."""
    shape = MeshShape.for_spec(spec.parallel)
    return [estimate(spec, pp_rank * shape.dp * shape.tp) for pp_rank in range(shape.pp)]


def in_flight(schedule: str, pp: int, virtual: int, microbatches: int, pp_rank: int) -> int:
    """Micro-batches (or, interleaved, chunks of one virtual stage) whose activations
    a rank holds at once."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, pp - pp_rank)
    v = 2 if schedule == "zero-bubble" else virtual
    return min(v * microbatches, (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)


def _stages(spec: JobSpec, pp_rank: int) -> list[tuple[int, bool, bool]]:
    """(blocks, has the embedding, has the head) of each stage the rank runs."""
    p, cfg = spec.parallel, spec.model_arch
    if p.pp == 1:
        return [(cfg.n_layers, True, True)]
    total = p.pp * p.virtual_stages
    ranges = split_layers(cfg, spec.train.seq_len, total)
    return [(len(ranges[i]), i == 0, i == total - 1) for i in stage_indices(pp_rank, p.pp, p.virtual_stages, p.schedule)]


def _states(spec: JobSpec, rank: int, teachers: tuple) -> StateBytes:
    if spec.engine == "deepspeed":
        zero = (spec.deepspeed.config or {}).get("zero_optimization", {})
        device = lambda key: (zero.get(key) or {}).get("device", "none")
        states = deepspeed_states(
            spec.model_arch,
            spec.parallel.dp,
            spec.train.precision,
            int(zero.get("stage", 0)) or 1,
            device("offload_optimizer"),
            device("offload_param"),
            spec.model.lora,
        )
        # Online teachers are whole fp32 copies on every rank under DeepSpeed.
        return replace(states, teacher=sum(FP32 * t.num_params() for t in teachers))
    return native_states(spec, rank, teachers)


def _gathered(spec: JobSpec, states: StateBytes, blocks: int) -> int:
    """Unsharded parameters (and one block's gradients) that ZeRO keeps for compute."""
    p = spec.parallel
    if spec.engine == "deepspeed":
        return states.largest_unit
    shape = MeshShape.for_spec(p)
    if not needs_wrapping(shape, spec.train.precision, p.cpu_offload) or shape.dp_shard == 1:
        return 0
    unit_grads = states.largest_unit * (2 if spec.train.precision in ("bf16", "fp16") else 1)  # one block's fp32 gradients
    held = 2 if p.zero == 3 else blocks
    return held * states.largest_unit + unit_grads
