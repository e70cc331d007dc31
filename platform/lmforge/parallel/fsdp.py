"""Data parallelism with FSDP2 (`fully_shard`): ZeRO-3, ZeRO-2 and replication.

Each transformer block is its own FSDP unit so that all-gathers overlap compute;
the root wraps what is left (embeddings, final norm, output head).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lmforge.parallel.mesh import ParallelDims
from lmforge.parallel.shape import MeshShape


def apply_fsdp(
    model: nn.Module, dims: ParallelDims, zero: int, precision: str, cpu_offload: bool = False, units: tuple[nn.Module, ...] = ()
) -> nn.Module:
    """`units`: submodules beside the blocks that are FSDP units of their own (called
    outside the model's forward, as distillation's adapters are)."""
    # Compute in bf16 or fp16, reduce gradients in fp32 into fp32 shards (fp16's loss scale: engines/loss_scale.py).
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    mp = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32) if half else MixedPrecisionPolicy()
    options = {
        "mesh": dims.dp_mesh,
        # ZeRO-2 keeps parameters gathered between forward and backward; ZeRO-3 frees them.
        "reshard_after_forward": zero == 3,
        "mp_policy": mp,
        # Pinned host memory makes the copies to the GPU asynchronous; without an
        # accelerator there is nothing to pin for (and torch refuses to).
        "offload_policy": CPUOffloadPolicy(pin_memory=dims.dp_mesh.device_type != "cpu") if cpu_offload else OffloadPolicy(),
    }
    for block in [*model.layers.values(), *units]:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


@contextmanager
def gathered_across_forwards(model: nn.Module, zero: int):
    """Many forwards in a row with no backward (generation): each unit's weights are
    gathered by the first and kept until the last (FSDP2's switch for evaluation),
    instead of an all-gather per unit per forward; then freed, and the unit set back."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]  # the root keeps its weights anyway
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(zero == 3, recurse=False)


def needs_wrapping(shape: MeshShape, precision: str, cpu_offload: bool) -> bool:
    """One fp32 data-parallel rank needs no FSDP at all (with or without TP); bf16 and
    fp16 still use FSDP2's mixed precision, and CPU offload its offload policy."""
    return shape.dp > 1 or precision != "fp32" or cpu_offload
