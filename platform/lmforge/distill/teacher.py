"""The online teacher on a training rank: built on the meta device like the student,
given its weights, then parallelized by the engine's own path (the same TP split;
FSDP-sharded when the student is). Frozen: eval mode, no gradients, no optimizer
state, never checkpointed.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from lmforge.checkpoint.export import open_source
from lmforge.models import Transformer, materialize


def build_teacher(path: str, device: torch.device, parallelize: Callable[[nn.Module], nn.Module]) -> nn.Module:
    source = open_source(path, name="distill.teacher")
    # A model directory is read tensor by tensor; a checkpoint is consolidated first.
    weights = source.read_tensors() if source.kind == "checkpoint" else str(source.path)
    with torch.device("meta"):
        teacher = Transformer(source.cfg)
    teacher = materialize(teacher, device, seed=0, weights=weights)
    teacher.requires_grad_(False)
    return parallelize(teacher).eval()
