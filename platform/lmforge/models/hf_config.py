"""Hugging Face Llama config.json <-> lmforge's ModelConfig (no torch import): the
keys transformers' LlamaConfig reads, and a refusal naming the field for whatever
lmforge cannot represent exactly.
"""

from __future__ import annotations

from pathlib import Path

from lmforge.jsonfile import read_object
from lmforge.models.config import ModelConfig, config_from_dict

CONFIG = "config.json"


def is_hf_dir(path: str | Path) -> bool:
    """A Hugging Face model directory: its config.json names a model type (lmforge's
    own config.json holds a `model` section instead)."""
    try:
        config = read_object(Path(path) / CONFIG)
    except ValueError:
        return False
    return isinstance(config, dict) and ("model_type" in config or "architectures" in config)


def config_to_hf(cfg: ModelConfig, eos_id: int | None, dtype: str) -> dict:
    """`dtype`: the weights' torch dtype name, e.g. bfloat16."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        # rope_theta for transformers 4.x, rope_parameters for 5.x.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_seq_len,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        # Packed documents are separated by the end-of-text token, so it also begins one.
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        "use_cache": True,
    }


def config_from_hf(config: dict, where: str) -> ModelConfig:
    """The lmforge shape of a Hugging Face config; ValueError naming the field lmforge
    cannot represent exactly."""

    def refuse(field: str, why: str):
        raise ValueError(f"{where}: {field} {why}; lmforge represents Llama models exactly or not at all")

    if config.get("model_type") != "llama" or config.get("architectures", ["LlamaForCausalLM"]) != ["LlamaForCausalLM"]:
        refuse("model_type", f"is {config.get('model_type')!r} ({', '.join(config.get('architectures') or [])}), not a LlamaForCausalLM")
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field):
            refuse(field, "is true (lmforge's projections have no biases)")
    if config.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"is {config['hidden_act']!r}, not silu")
    rope = config.get("rope_parameters") or {}
    if config.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        refuse("rope_scaling", f"is {config.get('rope_scaling') or rope} (only plain RoPE is supported)")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in config]
    if missing:
        refuse(missing[0], "is missing")
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        value = config.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            refuse(field, f"is {value!r}, not a positive whole number")
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if head_dim * heads != config["hidden_size"]:
        refuse("head_dim", f"is {head_dim}, not hidden_size / num_attention_heads = {config['hidden_size'] / heads:g}")
    return config_from_dict(
        dict(
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=config.get("num_key_value_heads") or heads,
            vocab_size=config["vocab_size"],
            ffn_hidden=config["intermediate_size"],
            max_seq_len=config.get("max_position_embeddings", 2048),
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        ),
        where,
    )
