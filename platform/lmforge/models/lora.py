"""LoRA (Hu et al. 2021, arXiv:2106.09685): chosen linear layers of the blocks learn a
low-rank update `B @ A`, scaled by alpha / rank, while every weight of the model stays
frozen. Applied from outside to a plain model, as parallelism is; `peft` reads the export.
"""

from __future__ import annotations

import importlib
import math
import sys
from typing import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.models.llama import named_generator
from lmforge.models.lora_config import NF4_BLOCK, LoraSpec, is_adapter, nf4_scaler_block


class LoraLinear(nn.Linear):
    """A frozen `nn.Linear` plus the update x A^T B^T * scaling. Still an `nn.Linear`, with
    its weight and bias under their own names, so tensor parallelism's plans and every
    checkpoint and export name apply unchanged; the adapters are two more parameters."""

    def __init__(self, base: nn.Linear, rank: int, scaling: float, dropout: float):
        nn.Module.__init__(self)  # the base's tensors are taken over, not allocated again
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        # A number, not a Dropout module: TP's row-wise plan expects every submodule to have a weight.
        self.scaling, self.dropout = scaling, dropout
        self.lora_a = nn.Parameter(torch.zeros(rank, self.in_features, device=base.weight.device, dtype=base.weight.dtype))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, device=base.weight.device, dtype=base.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(F.dropout(x, self.dropout, self.training), self.lora_a), self.lora_b)
        return F.linear(x, self.weight, self.bias) + update * self.scaling


def targeted_layers(model: nn.Module, targets: list[str]) -> Iterator[tuple[str, nn.Module, str]]:
    """(full name, parent module, attribute) of every targeted linear layer of the blocks
    `model` holds (a pipeline stage holds some)."""
    for block_name, block in model.layers.items():
        for name, module in block.named_modules():
            attribute = name.rpartition(".")[2]
            if attribute in targets and isinstance(module, nn.Linear):
                parent = block.get_submodule(name.rpartition(".")[0]) if "." in name else block
                yield f"layers.{block_name}.{name}", parent, attribute


@torch.no_grad()
def apply_lora(model: nn.Module, lora: LoraSpec, seed: int) -> int:
    """Replace the targeted layers of a materialized model (or stage) with `LoraLinear`s
    and freeze everything else; returns how many. A is drawn as peft draws it (Kaiming
    uniform, bound 1/sqrt(in)) from a generator seeded by (seed, name), so every layout
    starts from the same adapters; B starts at zero, so the model is unchanged at step 0.
    With `lora.quantize`, the adapted layers' weights are held in NF4 from here on."""
    for param in model.parameters():
        param.requires_grad_(False)
    adapted = 0
    for name, parent, attribute in list(targeted_layers(model, lora.targets)):
        layer = LoraLinear(getattr(parent, attribute), lora.rank, lora.scaling, lora.dropout)
        bound = 1 / math.sqrt(layer.in_features)
        layer.lora_a.copy_(torch.empty(layer.lora_a.shape).uniform_(-bound, bound, generator=named_generator(seed, f"{name}.lora_a")))
        if lora.quantize == "nf4":
            layer.weight = nn.Parameter(quantize_nf4(layer.weight.detach()), requires_grad=False)
        setattr(parent, attribute, layer)
        adapted += 1
    return adapted


def merged(tensors: Mapping[str, torch.Tensor], lora: LoraSpec) -> dict[str, torch.Tensor]:
    """The model's weights with each update folded in (W + scaling * B @ A, computed in float64), and
    the adapters left out: a plain model of the same shape."""
    out = {name: tensor for name, tensor in tensors.items() if not is_adapter(name)}
    for name in tensors:
        if name.endswith(".lora_a"):
            module = name[: -len(".lora_a")]
            a, b = tensors[name].double(), tensors[f"{module}.lora_b"].double()
            weight = out[f"{module}.weight"]
            out[f"{module}.weight"] = (weight.double() + lora.scaling * (b @ a)).to(weight.dtype)
    return out


# torchao's NF4 tensor, imported by the first QLoRA layer: importing torchao costs about
# a second per process, which every rank of every other job would pay.
NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"


def quantize_nf4(weight: torch.Tensor) -> torch.Tensor:
    """QLoRA's NF4 with double-quantized scalers (torchao's NF4Tensor), in blocks that
    every layout splits alike (`nf4_scaler_block`); computes in the weight's own dtype."""
    return importlib.import_module(NF4_MODULE).to_nf4(weight, NF4_BLOCK, nf4_scaler_block(weight.numel()))


def is_nf4(tensor: torch.Tensor) -> bool:
    """An NF4 weight, or FSDP's shard of one (none exists before torchao is imported)."""
    nf4 = sys.modules.get(NF4_MODULE)
    return nf4 is not None and isinstance(tensor.to_local() if isinstance(tensor, DTensor) else tensor, nf4.NF4Tensor)
