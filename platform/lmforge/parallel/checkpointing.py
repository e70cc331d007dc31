"""Activation checkpointing: recompute a block's activations in backward instead of
keeping them. `full` wraps every block, `selective` every k-th one."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int) -> None:
    if mode == "none":
        return
    for index, name in enumerate(list(model.layers.keys())):
        if mode == "full" or index % every == 0:
            model.layers[name] = checkpoint_wrapper(model.layers[name], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
