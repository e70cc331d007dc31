"""Bytes saved for backward by one micro-batch, per transformer block and for the
ends of the model, under each tensor-parallel and activation-checkpointing mode.

The method is Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4): list what each op keeps for its backward and sum
per token. Their formula, sbh(34 + 5as/h), is for GPT (4h GeLU MLP, dropout, an
s x s score matrix); this model differs, so its terms are recounted here, per token
and block, with d = dim, kv = kv_heads x head_dim, f = ffn_hidden, a = heads:

- each RMSNorm keeps its input and its normalized input (d each) and 1/rms (1);
- the linear layers after it keep their (gathered) input, d;
- attention keeps q (d), k and v (kv each), its output (d, also wo's input) and the
  log-sum-exp (a, fp32): fused SDPA stores no s x s matrix;
- the SwiGLU MLP keeps w1x, silu(w1x), w3x and their product (f each).

So a block keeps 8d + 2kv + 4f + a + 2 values per token. Tensor parallelism splits
the attention and MLP terms by t; sequence parallelism also splits the norms' terms
by t (Korthikanti 4.2.2), while each linear still keeps its all-gathered input.
Full recomputation keeps a block's input only (d per token, split by t with SP).
Op-level selective checkpointing keeps the matmul and attention outputs, recomputing
norms, RoPE and SiLU: the block input (d), q/k/v (d + 2kv), attention output and
log-sum-exp (d + a), wo's and w2's outputs (d each) and w1x, w3x (2f).
"""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.models.config import ModelConfig

FP32 = 4
INDEX = 8  # int64 token ids, kept by the embedding lookup


@dataclass(frozen=True)
class Shape:
    micro_batch: int
    seq_len: int
    tp: int = 1
    sequence_parallel: bool = False
    dtype_bytes: int = FP32  # activations: 4 in fp32, 2 in bf16

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def seq_split(self) -> int:
        """What the residual stream and norms are divided by."""
        return self.tp if self.sequence_parallel and self.tp > 1 else 1


def block_bytes(cfg: ModelConfig, shape: Shape, checkpointed: str = "none") -> int:
    """One block, one micro-batch. `checkpointed`: "none", "full" (recomputed from
    its input) or "op" (matmul and attention outputs kept, the rest recomputed)."""
    d, f, a = cfg.dim, cfg.ffn_hidden, cfg.n_heads
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    t, s, b = shape.tp, shape.seq_split, shape.dtype_bytes
    if checkpointed == "full":
        per_token = d * b / s
    elif checkpointed == "op":
        per_token = (d / s + (2 * q + 2 * kv + 2 * f) / t + 2 * d / s) * b + a / t * FP32
    else:
        norms = 2 * (2 * d + 1) / s  # two RMSNorms: input, normalized input, 1/rms
        gathered = 2 * d  # the inputs of the attention and MLP projections
        # q, attention output, k, v (and the q/k norms' inputs); four MLP tensors
        sharded = (2 * q + 2 * kv + (q + kv if cfg.qk_norm else 0) + 4 * f) / t
        per_token = (norms + gathered + sharded) * b + a / t * FP32
    return round(per_token * shape.tokens)


def first_stage_bytes(shape: Shape) -> int:
    """The embedding lookup keeps the token ids."""
    return shape.tokens * INDEX


def last_stage_bytes(cfg: ModelConfig, shape: Shape) -> int:
    """The final RMSNorm (as in a block) and the head's gathered input."""
    d, s = cfg.dim, shape.seq_split
    return round(((2 * d + 1) / s + d) * shape.dtype_bytes * shape.tokens)


def logits_bytes(cfg: ModelConfig, shape: Shape) -> int:
    """The head's logits (vocabulary split by t) and the fp32 log-softmax the loss
    keeps: the largest single buffer of the last stage for big vocabularies."""
    return round(shape.tokens * cfg.vocab_size / shape.tp * (shape.dtype_bytes + FP32))


def teacher_logits_bytes(cfg: ModelConfig, shape: Shape) -> int:
    """A teacher's logits for one micro-batch (vocabulary split by t), held beside the
    student's while the distillation loss runs."""
    return round(shape.tokens * cfg.vocab_size / shape.tp * shape.dtype_bytes)


def checkpoint_mode(index: int, mode: str, every: int | str) -> str:
    """How block `index` of a stage is checkpointed, mirroring
    `parallel.checkpointing.apply_activation_checkpointing`."""
    if mode == "full":
        return "full"
    if mode == "selective":
        if every == "op":
            return "op"
        return "full" if index % every == 0 else "none"
    return "none"


def stage_bytes(cfg: ModelConfig, shape: Shape, layers: int, first: bool, last: bool, mode: str = "none", every: int | str = 1) -> int:
    """All that one micro-batch keeps on a stage of `layers` blocks."""
    total = sum(block_bytes(cfg, shape, checkpoint_mode(i, mode, every)) for i in range(layers))
    return total + (first_stage_bytes(shape) if first else 0) + (last_stage_bytes(cfg, shape) if last else 0)


def kv_cache_bytes(cfg: ModelConfig, batch: int, seq_len: int, dtype_bytes: int = 2, tp: int = 1) -> int:
    """Inference KV cache: 2 (k and v) x batch x seq x layers x kv_heads x head_dim x
    bytes, the kv heads split by t."""
    return 2 * batch * seq_len * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes // tp
