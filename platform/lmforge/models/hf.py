"""Hugging Face weights (Llama, Qwen2, Qwen3, Mistral, Gemma 3, Qwen3-MoE) <-> lmforge: parameter names and the rotary convention
(HF rotates the two halves of a head, lmforge interleaved pairs, so q/k rows are
permuted across the boundary). Read with safetensors only, never a pickle.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from lmforge.jsonfile import member, read_object
from lmforge.models.config import ModelConfig

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# lmforge name (with {i} for the block) -> HF name.
_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.attention.wq.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "layers.{i}.attention.wk.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "layers.{i}.attention.wv.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "layers.{i}.attention.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.attention.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "layers.{i}.feed_forward.router.weight": "model.layers.{i}.mlp.gate.weight",
    "layers.{i}.feed_forward.experts.{j}.w1.weight": "model.layers.{i}.mlp.experts.{j}.gate_proj.weight",
    "layers.{i}.feed_forward.experts.{j}.w2.weight": "model.layers.{i}.mlp.experts.{j}.down_proj.weight",
    "layers.{i}.feed_forward.experts.{j}.w3.weight": "model.layers.{i}.mlp.experts.{j}.up_proj.weight",
}


# Gemma's block has four norms: its post_attention_layernorm follows attention (Llama's
# is the MLP's input norm, Gemma's pre_feedforward_layernorm).
_GEMMA_NAMES = _NAMES | {
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "layers.{i}.attention_out_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.ffn_out_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}


def hf_name(name: str, family: str = "llama") -> str:
    names = _GEMMA_NAMES if family == "gemma3_text" else _NAMES
    parts = name.split(".")
    if parts[0] != "layers":
        return names[name]
    rest, expert = parts[2:], None
    if rest[:2] == ["feed_forward", "experts"]:  # an expert's: its index is the second placeholder
        rest, expert = [*rest[:2], "{j}", *rest[3:]], rest[2]
    return names[".".join(["layers", "{i}", *rest])].format(i=parts[1], j=expert)


def _heads(name: str, cfg: ModelConfig) -> int | None:
    """How many rotary heads a tensor's rows hold (None: not rotated): q and k
    projections and their biases, and the q/k norms' one head of weights."""
    if name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return cfg.n_heads
    if name.endswith(("attention.wk.weight", "attention.wk.bias")):
        return cfg.n_kv_heads
    if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1
    return None


def to_hf_layout(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Rows of each head reordered from interleaved pairs (2j, 2j+1) to halves (j, j + d/2)."""
    heads = _heads(name, cfg)
    if heads is None:
        return tensor
    return tensor.reshape(heads, cfg.head_dim // 2, 2, -1).transpose(1, 2).reshape(tensor.shape)


def from_hf_layout(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    heads = _heads(name, cfg)
    if heads is None:
        return tensor
    return tensor.reshape(heads, 2, cfg.head_dim // 2, -1).transpose(1, 2).reshape(tensor.shape)


class HFFiles:
    """Which file of a Hugging Face directory (one file, or shards listed in an index)
    holds each tensor."""

    def __init__(self, path: Path, family: str):
        self.path, self.family = path, family
        self.files = self._files()

    def locate(self, name: str) -> tuple[Path | None, str]:
        """(the file, None when no file holds it; the HF name) of an lmforge tensor."""
        key = hf_name(name, self.family)
        return (self.path / self.files[key] if key in self.files else None), key

    def _files(self) -> dict[str, str]:
        if (self.path / INDEX).is_file():
            where = str(self.path / INDEX)
            weight_map = member(read_object(self.path / INDEX), "weight_map", dict, where)
            for shard in set(weight_map.values()):
                # A path in a file is data, not permission: shards live in the directory itself.
                if not isinstance(shard, str) or Path(shard).name != shard or shard in (".", ".."):
                    raise ValueError(f"{where}: names the shard {shard!r}, which is not a file of its own directory")
            absent = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
            if absent:
                raise ValueError(f"{self.path / INDEX}: lists the shard {absent[0]}, which is not there")
            return weight_map
        if not (self.path / WEIGHTS).is_file():
            pickled = [p for p in PICKLES if (self.path / p).exists()]
            if pickled:
                raise ValueError(
                    f"{self.path / pickled[0]}: a pickle, which lmforge never loads; convert it to safetensors "
                    "(transformers: model.save_pretrained(dir, safe_serialization=True))"
                )
            raise ValueError(f"{self.path}: holds neither {WEIGHTS} nor {INDEX}")
        with open_safetensors(self.path / WEIGHTS) as f:
            return {key: WEIGHTS for key in f.keys()}


@contextmanager
def open_safetensors(file: Path):
    """`safe_open`, with a file that is not safetensors reported as ValueError naming it."""
    try:
        handle = safe_open(str(file), framework="pt")
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for a bad header
        raise ValueError(f"{file}: not a safetensors file ({err})") from None
    with handle as f:
        yield f
