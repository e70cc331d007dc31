"""`model.lora`: which linear layers of the blocks learn low-rank adapters, and the
shapes and names that follow from it (no torch: the job file's checks use it)."""

from __future__ import annotations

from typing import Literal, Mapping, Optional

from pydantic import Field, field_validator

from lmforge.models.config import ModelConfig
from lmforge.section import Section

# The blocks' linear layers by lmforge's name, and the name Hugging Face (and peft's
# `target_modules`) give them. Mixture-of-experts layers' experts have the same three.
LINEAR_LAYERS = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
HF_TO_LMFORGE = {hf: ours for ours, hf in LINEAR_LAYERS.items()}
ADAPTER_PARAMS = ("lora_a", "lora_b")
# QLoRA's NF4 (Dettmers et al. 2023, arXiv:2305.14314): an absmax scaler per block of 64
# weights, the scalers quantized again in groups; the groups of a weight must divide
# into this many FSDP shards, whatever the layout, so every layout quantizes alike.
NF4_BLOCK, NF4_SHARDS = 64, 8


class LoraSpec(Section):
    """`model.lora`: train low-rank adapters instead of the model's weights."""

    rank: int = Field(8, gt=0, description="the adapters' rank r")
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input (training only)")
    targets: list[str] = Field(
        default_factory=lambda: list(LINEAR_LAYERS),
        description="the blocks' linear layers that get adapters, by lmforge's (wq, w1) or Hugging Face's (q_proj, gate_proj) name",
    )
    quantize: Optional[Literal["nf4"]] = Field(None, description="nf4: the adapted layers' frozen weights in 4-bit NormalFloat (QLoRA)")

    @field_validator("targets")
    @classmethod
    def _known_layers(cls, targets: list[str]) -> list[str]:
        if not targets:
            raise ValueError("name at least one linear layer")
        unknown = [t for t in targets if t not in LINEAR_LAYERS and t not in HF_TO_LMFORGE]
        if unknown:
            raise ValueError(
                f"{unknown[0]!r} matches no linear layer of the blocks; choose from {', '.join(LINEAR_LAYERS)} (or {', '.join(HF_TO_LMFORGE)})"
            )
        return list(dict.fromkeys(HF_TO_LMFORGE.get(t, t) for t in targets))  # lmforge's names, each once

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def layer_sides(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear layer of the blocks by its name; with experts, the
    narrower of the dense and expert MLPs' widths."""
    attention = cfg.n_heads * cfg.head_dim
    kv = cfg.n_kv_heads * cfg.head_dim
    widths = [
        w
        for w, used in ((cfg.ffn_hidden, any(not cfg.has_experts(i) for i in range(cfg.n_layers))), (cfg.expert_ffn_hidden, cfg.n_experts > 0))
        if used
    ]
    mlp = min(widths)
    return {
        "wq": (attention, cfg.dim),
        "wk": (kv, cfg.dim),
        "wv": (kv, cfg.dim),
        "wo": (cfg.dim, attention),
        "w1": (mlp, cfg.dim),
        "w2": (cfg.dim, mlp),
        "w3": (mlp, cfg.dim),
    }


def rank_refusal(cfg: ModelConfig, lora: LoraSpec) -> str | None:
    """Why `lora.rank` does not fit the targeted layers (None: it does): a rank above a
    layer's smaller side is no longer a low-rank update."""
    sides = {target: min(layer_sides(cfg)[target]) for target in lora.targets}
    narrowest = min(sides, key=sides.get)
    if lora.rank > sides[narrowest]:
        return (
            f"{lora.rank} is larger than the {narrowest} layers ({sides[narrowest]} on their smaller side); use a rank of at most {sides[narrowest]}"
        )
    return None


def adapter_shapes(weight_shapes: Mapping[str, tuple[int, ...]], lora: LoraSpec) -> dict[str, tuple[int, int]]:
    """The adapters' (name, shape) for the targeted weights among `weight_shapes`
    (lmforge's names): A is (rank, in), B (out, rank)."""
    shapes = {}
    for name, shape in weight_shapes.items():
        module, _, kind = name.rpartition(".")
        if kind == "weight" and name.startswith("layers.") and module.rpartition(".")[2] in lora.targets and len(shape) == 2:
            shapes[f"{module}.lora_a"] = (lora.rank, shape[1])
            shapes[f"{module}.lora_b"] = (shape[0], lora.rank)
    return shapes


def quantized_weights(adapters, lora: LoraSpec | None) -> set[str]:
    """The weights QLoRA holds in NF4: those of the layers `adapters` (names from
    `adapter_shapes`) adapt; none without `quantize`."""
    if lora is None or not lora.quantize:
        return set()
    return {f"{name.removesuffix('.lora_a')}.weight" for name in adapters if name.endswith(".lora_a")}


def is_adapter(name: str) -> bool:
    return name.rpartition(".")[2] in ADAPTER_PARAMS


def nf4_scaler_block(numel: int) -> int | None:
    """Scalers per second-level group for a weight of `numel` elements: QLoRA's 256, or
    fewer for a small layer, leaving a multiple of NF4_SHARDS groups; None: none does."""
    if numel % NF4_BLOCK:
        return None
    scalers, size = numel // NF4_BLOCK, 256
    while size and scalers % (size * NF4_SHARDS):
        size //= 2
    return size or None


def nf4_bytes(numel: int, shards: int = 1) -> int:
    """What an NF4 weight (torchao's NF4Tensor) holds, on one of `shards` FSDP ranks: the
    4-bit codes, the int8 scalers and fp32 group factors split, the fp32 scaler mean and
    16-value code book whole."""
    scalers = numel // NF4_BLOCK
    groups = scalers // (nf4_scaler_block(numel) or 1)
    return (numel // 2 + scalers + 4 * groups) // shards + 4 + 16 * 4


def nf4_refusal(cfg: ModelConfig, lora: LoraSpec) -> str | None:
    """Why the targeted layers cannot be held in NF4 on every layout (None: they can)."""
    for target in lora.targets:
        out, into = layer_sides(cfg)[target]
        if nf4_scaler_block(out * into) is None or out % NF4_SHARDS:
            return (
                f"the {target} layers ({out} x {into}) do not split into NF4 blocks of {NF4_BLOCK} weights in groups that "
                f"FSDP can shard over up to {NF4_SHARDS} ranks"
            )
    return None
