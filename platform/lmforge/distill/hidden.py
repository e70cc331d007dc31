"""Intermediate-layer distillation: a student block's output, through a learned
linear adapter to the teacher's width, matched to a teacher block's output.

Adapters start as the identity when the widths agree (the loss then starts as the
plain distance), and are trained with the student. `BlockOutputs` records the
outputs of chosen blocks with forward hooks, so the model files stay plain.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN_LOSSES = ("mse", "cosine")
ADAPTERS = "distill_adapters"  # the attribute of the student that holds them (its checkpoint keys' prefix)


class HiddenAdapters(nn.Module):
    """One adapter per mapped student layer. One call adapts every mapped layer's
    output, so that under FSDP the adapters are one unit gathered once per micro-batch."""

    def __init__(self, layers: dict[int, int], student_dim: int, teacher_dim: int, seed: int = 0):
        super().__init__()
        self.layers = dict(layers)
        self.adapters = nn.ModuleDict({str(s): nn.Linear(student_dim, teacher_dim, bias=False) for s in self.layers})
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)  # the same adapters on every rank
        for adapter in self.adapters.values():
            if adapter.in_features == adapter.out_features:
                adapter.weight.copy_(torch.eye(adapter.in_features))
            else:
                bound = (6 / (adapter.in_features + adapter.out_features)) ** 0.5  # Xavier-uniform
                adapter.weight.copy_(torch.empty(adapter.weight.shape).uniform_(-bound, bound, generator=generator))

    def forward(self, *student_hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The mapped student layers' outputs, in `layers` order, adapted."""
        return tuple(self.adapters[str(s)](h) for s, h in zip(self.layers, student_hidden))


class BlockOutputs:
    """The latest output of each chosen block of a model (`model.layers[str(i)]`),
    recorded by a forward hook; with activation checkpointing the hook sits on the
    wrapper, so the recomputation in the backward does not record again."""

    def __init__(self, model: nn.Module, layers):
        self.outputs: dict[int, torch.Tensor] = {}
        self.handles = [model.layers[str(i)].register_forward_hook(self._recorder(i)) for i in dict.fromkeys(layers)]

    def _recorder(self, layer: int):
        def record(_module, _inputs, output):
            self.outputs[layer] = output

        return record

    def take(self, layers) -> list[torch.Tensor]:
        """The recorded outputs of `layers`, in that order; forgets them all."""
        taken = [self.outputs[i] for i in layers]
        self.outputs.clear()
        return taken

    def clear(self) -> None:
        """Forget what a forward recorded that no loss uses (a held-out batch's)."""
        self.outputs.clear()


def hidden_terms(student: torch.Tensor, teacher: torch.Tensor, loss: str) -> torch.Tensor:
    """Per-token distance (shape: the inputs' without the last dim), in fp32."""
    student, teacher = student.float(), teacher.detach().float()
    if loss == "mse":
        return (student - teacher).pow(2).mean(dim=-1)
    if loss == "cosine":
        return 1 - F.cosine_similarity(student, teacher, dim=-1)
    raise ValueError(f"unknown hidden loss {loss!r}; choose one of {', '.join(HIDDEN_LOSSES)}")


def hidden_loss_sum(adapted: list[torch.Tensor], teacher_hidden: list[torch.Tensor], mask: Optional[torch.Tensor], loss: str) -> torch.Tensor:
    """Sum over mapped layer pairs and unmasked tokens of the distance between each
    adapted student output and its teacher output; the caller divides by N."""
    total = torch.zeros((), device=adapted[0].device)
    for student, teacher in zip(adapted, teacher_hidden, strict=True):
        terms = hidden_terms(student, teacher, loss)
        total = total + (terms if mask is None else terms * mask.float()).sum()
    return total
