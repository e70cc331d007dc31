"""A step-time model, for ranking the layouts of one job on one cluster (not for
predicting absolute speed). Per optimizer step and rank, with W ranks, T tokens per
step, m micro-batches of b x s tokens, t/p/d the tp/pp/dp sizes:

- compute: (6N + attention) FLOPs per token (PaLM, appendix B) x T / W at
  `peak_tflops x efficiency`; fp32 at half the bf16 peak (TF32).
- recompute: full checkpointing runs each block's forward again, +1/3 of its FLOPs
  (Korthikanti et al. 2022, section 5); every k-th block, 1/(3k); op-level (matmul
  outputs kept) only norms, RoPE and SiLU: counted as 2%.
- pipeline bubble: (p - 1) / (v m) of the compute (Narayanan et al. 2021, section
  2.2; v virtual stages per rank). Zero-bubble is counted as interleaved with v = 2.
- tensor parallel: per block and micro-batch, 2 all-reduces forward and 2 backward
  of the b x s x dim activations (Megatron-LM; with sequence parallelism the same
  volume as all-gather + reduce-scatter pairs), 2 more when full recomputation
  repeats the forward; a ring moves 2 (t - 1) / t of the buffer per rank, over the
  node's links (tp stays inside a node). On the critical path, not overlapped.
- data parallel: gradients reduced in fp32, all-reduce 2 (d - 1) / d G with zero 0,
  reduce-scatter (d - 1) / d G plus the updated parameters' all-gather (d - 1) / d P
  with zero 2, and zero 3 gathering the parameters again for the forward and the
  backward of each micro-batch, 2 m (d - 1) / d P (the ZeRO paper, section 7: 1.5x
  DDP's volume at m = 1). Ranks are placed replicas outermost (cluster.topology):
  the DP group spans nodes unless all its replicas fit on one. It overlaps
  the backward (bucketed reduce-scatter, prefetched all-gathers): only what exceeds
  the backward's compute, 2/3 of the step's, is exposed.
- pipeline point-to-point: each stage boundary sends the b x s x dim activation
  forward and its gradient back per micro-batch, between nodes when a replica is
  larger than a node.
- CPU offload (FSDP2's, `parallel.cpu_offload`): the rank's fp32 parameter shard
  copied to the device for each forward and backward of each micro-batch with zero
  3 (once a step otherwise) and its fp32 gradient shard back, over `host_gbps`;
  then the optimizer step on the CPU streams the shard's parameter, gradient and two
  moments in and writes three back (28 bytes a parameter) at `cpu_gbps`. Counted as
  not overlapped: an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmforge.planner.cluster import Cluster
    from lmforge.spec import JobSpec

OP_RECOMPUTE = 0.02
COSTS = ("compute", "recompute", "bubble", "tp_comm", "dp_comm", "pp_comm", "offload")
CPU_ADAM_BYTES = 28  # per parameter: p, g, m, v read; p, m, v written


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by cause."""

    compute: float
    recompute: float
    bubble: float
    tp_comm: float
    dp_comm: float  # exposed only
    pp_comm: float
    offload: float = 0.0
    dp_hidden: float = 0.0  # DP traffic that overlaps the backward (not in the total)

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self) if f.name in COSTS)

    def overheads(self) -> dict[str, float]:
        """Each cost beyond the model's own compute, as a share of the step."""
        return {name: getattr(self, name) / self.total for name in COSTS if name != "compute"}


def recompute_share(mode: str, every: int | str) -> float:
    if mode == "full":
        return 1 / 3
    if mode == "selective":
        return OP_RECOMPUTE if every == "op" else 1 / (3 * every)
    return 0.0


def step_time(spec: JobSpec, cluster: Cluster) -> StepTime:
    p, train, cfg = spec.parallel, spec.train, spec.model_arch
    world, m = spec.world_size, spec.grad_accum
    act_bytes = 4 if train.precision == "fp32" else 2
    flops = cfg.flops_per_token(train.seq_len) * train.global_batch * train.seq_len / world
    rate = cluster.peak_tflops * 1e12 * cluster.efficiency * (0.5 if train.precision == "fp32" else 1.0)
    compute = flops / rate
    recompute = compute * recompute_share(p.activation_checkpointing, p.ac_every)
    bubble = (compute + recompute) * (p.pp - 1) / (_virtual(spec) * m) if p.pp > 1 else 0.0

    activation = train.micro_batch * train.seq_len * cfg.dim * act_bytes
    blocks = cfg.n_layers / p.pp
    collectives = 4 + (2 if p.activation_checkpointing == "full" else 0)
    tp_bytes = collectives * blocks * m * activation * 2 * (p.tp - 1) / p.tp
    tp_comm = tp_bytes / (cluster.intra_gbps * 1e9)

    params = cfg.num_params() / (p.pp * p.tp)
    # As placed (cluster.topology): a replica's pp x tp ranks on as few nodes as hold
    # them, whole replicas side by side on a node while they fit.
    replica_ranks = p.tp * p.pp
    replicas_per_node = cluster.gpus_per_node // replica_ranks
    dp_comm = _dp_bytes(p.zero, p.dp, m, params, act_bytes) / _bandwidth(cluster, replicas_per_node < p.dp)
    dp_exposed = max(0.0, dp_comm - 2 / 3 * (compute + recompute))

    pp_bytes = 2 * m * activation / (p.tp if p.sequence_parallel else 1) if p.pp > 1 else 0.0
    pp_comm = pp_bytes / _bandwidth(cluster, replicas_per_node == 0)
    offload = _offload_seconds(p.zero, m, params / p.dp, cluster) if p.cpu_offload else 0.0
    return StepTime(compute, recompute, bubble, tp_comm, dp_exposed, pp_comm, offload, dp_hidden=dp_comm - dp_exposed)


def _offload_seconds(zero: int, microbatches: int, shard: float, cluster: Cluster) -> float:
    copies = 4 * shard * (2 * microbatches if zero == 3 else 1) + 4 * shard  # fp32 parameters in, gradients out
    return copies / (cluster.host_gbps * 1e9) + CPU_ADAM_BYTES * shard / (cluster.cpu_gbps * 1e9)


def tokens_per_second_per_gpu(spec: JobSpec, time: StepTime) -> float:
    return spec.train.global_batch * spec.train.seq_len / time.total / spec.world_size


def model_flops_utilization(spec: JobSpec, time: StepTime, cluster: Cluster) -> float:
    """The step's model FLOPs over the peak of the GPUs it uses (what `mfu` reports
    during training)."""
    peak = cluster.peak_tflops * 1e12 * (0.5 if spec.train.precision == "fp32" else 1.0)
    return tokens_per_second_per_gpu(spec, time) * spec.model_arch.flops_per_token(spec.train.seq_len) / peak


def _virtual(spec: JobSpec) -> int:
    return 2 if spec.parallel.schedule == "zero-bubble" else spec.parallel.virtual_stages


def _dp_bytes(zero: int, dp: int, microbatches: int, params: float, param_bytes: int) -> float:
    if dp == 1:
        return 0.0
    ring = (dp - 1) / dp
    grads = 4 * params  # reduced in fp32
    if zero == 0:
        return 2 * ring * grads
    gathered = ring * param_bytes * params
    return ring * grads + gathered * (2 * microbatches if zero == 3 else 1)


def _bandwidth(cluster: Cluster, between_nodes: bool) -> float:
    """Bytes per second per rank: a DP group spans nodes when a stage's ranks do not
    fit in one; a stage boundary crosses nodes when a stage fills its node."""
    return 1e9 * (cluster.inter_gbps if cluster.nodes > 1 and between_nodes else cluster.intra_gbps)
