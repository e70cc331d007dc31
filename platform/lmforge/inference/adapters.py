"""Many LoRA adapters on one served model: each row of a batch takes the update of its
own adapter (row index 0: none), so requests for different adapters share one forward,
as S-LoRA and vLLM's multi-LoRA batch them (Sheng et al. 2023, arXiv:2311.03285)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn

from lmforge.models.lora import targeted_layers
from lmforge.models.lora_config import LINEAR_LAYERS
from lmforge.models.peft_format import Adapter

ATTACHED = "_multi_adapter_layers"  # the model's `MultiAdapterLinear` layers, found once at attach time


class MultiAdapterLinear(nn.Module):
    """A frozen linear layer plus stacked factors: A (adapters + 1, rank, in), B (adapters
    + 1, out, rank) with each adapter's scaling folded into its B, padded to the largest
    rank with zeros, slot 0 all zeros. `rows` picks each batch row's slot."""

    def __init__(self, base: nn.Linear, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.base = base
        self.register_buffer("a", a, persistent=False)
        self.register_buffer("b", b, persistent=False)
        self.rows: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.rows is None:
            return out
        a, b = self.a[self.rows], self.b[self.rows]  # (batch, rank, in), (batch, out, rank)
        return out + torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))


def attach_adapters(model: nn.Module, adapters: list[Adapter]) -> None:
    """Every linear layer of the blocks that any adapter targets becomes a
    `MultiAdapterLinear` holding all adapters (zeros where one does not target it);
    adapter i answers at row index i + 1."""
    rank = max(adapter.rank for adapter in adapters)
    targets = list(LINEAR_LAYERS)
    param = next(model.parameters())
    attached = []
    for name, parent, attribute in list(targeted_layers(model, targets)):
        if not any(f"{name}.lora_a" in adapter.factors for adapter in adapters):
            continue
        base = getattr(parent, attribute)
        a = torch.zeros(len(adapters) + 1, rank, base.in_features, dtype=param.dtype, device=param.device)
        b = torch.zeros(len(adapters) + 1, base.out_features, rank, dtype=param.dtype, device=param.device)
        for slot, adapter in enumerate(adapters, start=1):
            if f"{name}.lora_a" in adapter.factors:
                a[slot, : adapter.rank] = adapter.factors[f"{name}.lora_a"]
                b[slot, :, : adapter.rank] = adapter.factors[f"{name}.lora_b"] * adapter.scaling
        attached.append(MultiAdapterLinear(base, a, b))
        setattr(parent, attribute, attached[-1])
    object.__setattr__(model, ATTACHED, attached)  # a plain list, not submodules registered twice


@contextmanager
def adapter_rows(model: nn.Module, rows: list[int]) -> Iterator[None]:
    """Each batch row's adapter slot (0: the base model alone) for the forwards inside;
    nothing to do when no row asks for one."""
    layers = getattr(model, ATTACHED, []) if any(rows) else []
    index = torch.tensor(rows, device=next(model.parameters()).device) if layers else None
    for layer in layers:
        layer.rows = index
    try:
        yield
    finally:
        for layer in layers:
            layer.rows = None
