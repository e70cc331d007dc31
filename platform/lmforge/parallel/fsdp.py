"""Data parallelism with FSDP2 (`fully_shard`): ZeRO-3, ZeRO-2 and replication.

Each transformer block is its own FSDP unit so that all-gathers overlap compute;
the root wraps what is left (embeddings, final norm, output head).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lmforge.parallel.mesh import ParallelDims


def apply_fsdp(model: nn.Module, dims: ParallelDims, zero: int, precision: str) -> nn.Module:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else MixedPrecisionPolicy()
    # ZeRO-2 keeps parameters gathered between forward and backward; ZeRO-3 frees them.
    reshard = zero == 3
    for block in model.layers.values():
        fully_shard(block, mesh=dims.dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=dims.dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    return model


def needs_wrapping(dims: ParallelDims, precision: str) -> bool:
    """One fp32 data-parallel rank needs no FSDP at all (with or without TP); bf16
    still uses FSDP2's mixed precision."""
    return dims.shape.dp > 1 or precision != "fp32"
