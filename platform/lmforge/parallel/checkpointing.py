"""Activation checkpointing: recompute activations in backward instead of keeping them.

`full` wraps every block; `selective` wraps every k-th block, or (`ac_every: op`)
every block with a policy that keeps matmul, attention and reduce-scatter outputs
and recomputes only the cheap element-wise ops (norms, RoPE, SiLU) between them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# The expensive ops: recomputing them would cost as much as the forward itself.
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def _keep_expensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def op_level_context():
    return create_selective_checkpoint_contexts(_keep_expensive)


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int | str) -> None:
    if mode == "none":
        return
    op_level = mode == "selective" and every == "op"
    extra = {"context_fn": op_level_context} if op_level else {}
    for index, name in enumerate(list(model.layers.keys())):
        if mode == "full" or op_level or index % every == 0:
            model.layers[name] = checkpoint_wrapper(model.layers[name], checkpoint_impl=CheckpointImpl.NO_REENTRANT, **extra)
