"""Intermediate-layer distillation: a student block's output, through a learned
linear adapter to the teacher's width, matched to a teacher block's output.

Adapters start as the identity when the widths agree (the loss then starts as the
plain distance), and are trained with the student.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN_LOSSES = ("mse", "cosine")


class HiddenAdapters(nn.Module):
    """One adapter per mapped student layer, keyed by the student layer's index."""

    def __init__(self, layers: dict[int, int], student_dim: int, teacher_dim: int):
        super().__init__()
        self.layers = dict(layers)
        self.adapters = nn.ModuleDict({str(s): nn.Linear(student_dim, teacher_dim, bias=False) for s in self.layers})
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for adapter in self.adapters.values():
            if adapter.in_features == adapter.out_features:
                adapter.weight.copy_(torch.eye(adapter.in_features))
            else:
                nn.init.xavier_uniform_(adapter.weight)

    def forward(self, student_layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.adapters[str(student_layer)](hidden)


def hidden_terms(student: torch.Tensor, teacher: torch.Tensor, loss: str) -> torch.Tensor:
    """Per-token distance (shape: the inputs' without the last dim), in fp32."""
    student, teacher = student.float(), teacher.detach().float()
    if loss == "mse":
        return (student - teacher).pow(2).mean(dim=-1)
    if loss == "cosine":
        return 1 - F.cosine_similarity(student, teacher, dim=-1)
    raise ValueError(f"unknown hidden loss {loss!r}; choose one of {', '.join(HIDDEN_LOSSES)}")


def hidden_loss_sum(adapters: HiddenAdapters, student_hidden: dict[int, torch.Tensor], teacher_hidden: dict[int, torch.Tensor],
                    mask: Optional[torch.Tensor], loss: str) -> torch.Tensor:
    """Sum over mapped layer pairs and unmasked tokens of the distance between the
    adapted student output and the teacher's; the caller divides by N."""
    total = torch.zeros((), device=next(iter(student_hidden.values())).device)
    for s_layer, t_layer in adapters.layers.items():
        terms = hidden_terms(adapters(s_layer, student_hidden[s_layer]), teacher_hidden[t_layer], loss)
        total = total + (terms if mask is None else terms * mask.float()).sum()
    return total
