"""Hugging Face config.json (Llama, Qwen2, Qwen3, Mistral) <-> lmforge's ModelConfig
(no torch import): the keys transformers' configs read, and a refusal naming the
field for whatever lmforge cannot represent exactly.
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


ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def config_to_hf(cfg: ModelConfig, eos_id: int | None, dtype: str) -> dict:
    """`dtype`: the weights' torch dtype name, e.g. bfloat16."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        scaling = cfg.rope_scaling
        rope = {"rope_type": scaling.kind, "rope_theta": cfg.rope_theta, "factor": scaling.factor}
        if scaling.kind == "llama3":
            rope |= {
                "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_seq_len,
            }
    config = {
        "architectures": [ARCHITECTURES[cfg.family]],
        "model_type": cfg.family,
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
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_seq_len,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        # Packed documents are separated by the end-of-text token, so it also begins one.
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if cfg.family in ("llama", "qwen3", "qwen3_moe"):
        config["attention_bias"] = False
    if cfg.family == "llama":
        config["mlp_bias"] = False
    window = cfg.sliding_window or None
    kinds = ["full_attention" if cfg.window_of(i) == 0 else "sliding_attention" for i in range(cfg.n_layers)]
    if cfg.family == "qwen3_moe":
        config |= {
            "num_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.experts_per_token,
            "moe_intermediate_size": cfg.expert_ffn_hidden,
            "norm_topk_prob": cfg.normalize_top_k,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(cfg.dense_layers),
        }
    if cfg.family in ("qwen2", "qwen3", "qwen3_moe"):
        config |= {
            "use_sliding_window": window is not None,
            "sliding_window": window,
            "max_window_layers": kinds.count("full_attention"),
            "layer_types": kinds,
        }
    if cfg.family == "mistral":
        config["sliding_window"] = window
    if cfg.family == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope_theta}
        for name in ("hidden_act", "rope_theta"):
            config.pop(name)
        config |= {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": _whole(cfg.query_pre_attn_scalar or cfg.head_dim),  # transformers wants an int
            "sliding_window": window,
            "layer_types": kinds,
            "rope_parameters": {"full_attention": rope, "sliding_attention": local},
            "attention_bias": False,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        }
    return config


def _whole(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def config_from_hf(config: dict, where: str) -> ModelConfig:
    """The lmforge shape of a Hugging Face config; ValueError naming the field lmforge
    cannot represent exactly."""

    def refuse(field: str, why: str):
        raise ValueError(f"{where}: {field} {why}; lmforge represents a model exactly or not at all")

    family = config.get("model_type")
    if family not in ARCHITECTURES or config.get("architectures", [ARCHITECTURES.get(family)]) != [ARCHITECTURES.get(family)]:
        known = ", ".join(ARCHITECTURES.values())
        refuse("model_type", f"is {family!r} ({', '.join(config.get('architectures') or [])}), not one of {known}")
    if config.get("auto_map"):
        refuse("auto_map", "asks for the model's own code (trust_remote_code), which lmforge never runs")
    for name in ("attention_bias", "mlp_bias"):
        if config.get(name):
            refuse(name, f"is true ({family}'s projections in lmforge have no such biases)")
    if family != "gemma3_text" and config.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"is {config['hidden_act']!r}, not silu")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in config]
    if missing:
        refuse(missing[0], "is missing")
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            refuse(name, f"is {value!r}, not a positive whole number")
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if head_dim % 2:
        refuse("head_dim", f"is {head_dim}, not even (rotary embeddings turn pairs)")
    rope = config.get("rope_parameters") or {}
    gemma = _gemma3(config, refuse) if family == "gemma3_text" else {}
    experts = _experts(config, refuse) if family == "qwen3_moe" else {}
    if gemma:
        rope = rope.get("full_attention") or {"rope_theta": config.get("rope_theta", 1_000_000.0), **(config.get("rope_scaling") or {})}
    shape = dict(
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
        family=family,
        head_dim=head_dim,
        qkv_bias=family == "qwen2",
        qk_norm=family in ("qwen3", "qwen3_moe"),
        rope_scaling=_rope_scaling(rope if gemma else config.get("rope_scaling") or rope, refuse),
        **_sliding_window(config, refuse),
    )
    return config_from_dict(shape | gemma | experts, where)


def _experts(config: dict, refuse) -> dict:
    """Qwen3-MoE's experts: every `decoder_sparse_step`-th layer not in `mlp_only_layers`.
    The hub's configs say `num_experts`; transformers 5 saves it as `num_local_experts`."""
    config = {"num_experts": config.get("num_local_experts")} | {k: v for k, v in config.items() if v is not None}
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            refuse(name, f"is {value!r}, not a positive whole number")
    step, only = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers") or []
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        refuse("decoder_sparse_step", f"is {step!r}, not a positive whole number")
    dense = [i for i in range(config["num_hidden_layers"]) if i in only or (i + 1) % step]
    return {
        "n_experts": config["num_experts"],
        "experts_per_token": config["num_experts_per_tok"],
        "expert_ffn_hidden": config["moe_intermediate_size"],
        "normalize_top_k": bool(config.get("norm_topk_prob", False)),
        "dense_layers": dense,
    }


def _gemma3(config: dict, refuse) -> dict:
    """Gemma 3's switches: (1 + w) norms before and after attention and the MLP, q/k
    norms, GeGLU, embeddings scaled by sqrt(hidden), `query_pre_attn_scalar`, and the
    sliding layers' own RoPE base. Soft-capping and bidirectional attention refused."""
    if config.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        refuse("hidden_activation", f"is {config['hidden_activation']!r}, not gelu_pytorch_tanh")
    for name in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
        if config.get(name):
            refuse(name, f"is {config[name]!r} (not implemented)")
    rope = config.get("rope_parameters") or {}
    local = rope.get("sliding_attention") or {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    if local.get("rope_type", "default") != "default":
        refuse("rope_parameters", f"sliding_attention is {local} (only default RoPE on the sliding layers)")
    scalar = config.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
        refuse("query_pre_attn_scalar", f"is {scalar!r}, not a positive number")
    return {
        "qk_norm": True,
        "unit_offset_norms": True,
        "sandwich_norms": True,
        "embed_scale": True,
        "activation": "gelu_tanh",
        "query_pre_attn_scalar": float(scalar),
        "local_rope_theta": float(local.get("rope_theta", 10_000.0)),
    }


def _sliding_window(config: dict, refuse) -> dict:
    """Which layers see only a window of the last positions, as transformers reads the
    config: Mistral's `sliding_window` applies to every layer; Qwen's only with
    `use_sliding_window`, to the layers `layer_types` (or `max_window_layers`) name."""
    family, layers = config.get("model_type"), config["num_hidden_layers"]
    window = config.get("sliding_window")
    if family == "llama" or (family in ("qwen2", "qwen3", "qwen3_moe") and not config.get("use_sliding_window")):
        window = None
    if window is None:
        return {}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        refuse("sliding_window", f"is {window!r}, not a positive whole number")
    kinds = config.get("layer_types") if family != "mistral" else None
    if kinds is None and family == "gemma3_text":  # its pattern: every n-th layer full
        pattern = config.get("sliding_window_pattern", 6)
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if kinds is None:
        first = config.get("max_window_layers", 0) if family != "mistral" else 0
        kinds = ["full_attention" if i < first else "sliding_attention" for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {"full_attention", "sliding_attention"}:
        refuse("layer_types", f"is {kinds!r}, not full_attention or sliding_attention for each of the {layers} layers")
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    return {} if len(full) == layers else {"sliding_window": window, "full_attention_layers": full}


def _rope_scaling(rope: dict, refuse) -> dict | None:
    """Llama 3's and linear RoPE scaling as lmforge's `rope_scaling`; the rest refused."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("llama3", "linear"):
        refuse("rope_scaling", f"is of type {kind!r} (lmforge implements default, llama3 and linear)")
    if rope.get("attention_factor") not in (None, 1, 1.0):
        refuse("rope_scaling", f"has attention_factor {rope['attention_factor']} (only 1 is implemented)")
    scaling = {"kind": kind, "factor": rope.get("factor")}
    if kind == "llama3":
        scaling |= {
            "low_freq_factor": rope.get("low_freq_factor"),
            "high_freq_factor": rope.get("high_freq_factor"),
            "original_max_seq_len": rope.get("original_max_position_embeddings"),
        }
    for name, value in scaling.items():
        if name != "kind" and (value is None or isinstance(value, bool) or not isinstance(value, (int, float))):
            refuse("rope_scaling", f"has {name} {value!r}, not a number")
    return scaling
