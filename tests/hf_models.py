"""Small random models of each family lmforge represents, made by transformers itself
(`AutoConfig.for_model` and `save_pretrained`, no hub download), with a byte-level BPE tokenizer trained here:
the independent reference for Hugging Face interchange and generation."""

from __future__ import annotations

import shutil
from pathlib import Path

VOCAB = 320
# Per family transformers supports and lmforge represents: tied and untied embeddings,
# grouped-query and multi-head attention, Llama 3's RoPE scaling (its original context
# shorter than the tests' prompts, so it applies), Qwen2's q/k/v biases, Qwen3's q/k
# norms and a head_dim that is not hidden/heads, Mistral, sliding windows.
LAYOUTS = {
    "untied-gqa": {"model_type": "llama", "tie_word_embeddings": False, "num_key_value_heads": 2},
    "tied-gqa": {"model_type": "llama", "tie_word_embeddings": True, "num_key_value_heads": 2},
    "untied-mha": {"model_type": "llama", "tie_word_embeddings": False, "num_key_value_heads": 4},
    "llama3": {
        "model_type": "llama",
        "tie_word_embeddings": True,
        "num_key_value_heads": 2,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    },
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True, "num_key_value_heads": 2},
    "qwen3": {"model_type": "qwen3", "tie_word_embeddings": False, "num_key_value_heads": 2, "head_dim": 24},
    "mistral": {"model_type": "mistral", "tie_word_embeddings": False, "num_key_value_heads": 2, "head_dim": 32, "sliding_window": None},
    # Sliding windows shorter than the tests' prompts and generations: Mistral v0.1's on
    # every layer, Qwen's above `max_window_layers`.
    "mistral-window": {"model_type": "mistral", "tie_word_embeddings": False, "num_key_value_heads": 2, "sliding_window": 8},
    # Gemma 3 (text): a pattern of sliding layers (window 8) and a full one, each with its
    # RoPE base, the full layers' scaled linearly.
    "gemma3": {
        "model_type": "gemma3_text",
        "tie_word_embeddings": True,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 5_000.0},
        },
    },
    # A mixture of experts: 4 experts, the top 2 renormalized, layer 1 dense.
    "qwen3-moe": {
        "model_type": "qwen3_moe",
        "tie_word_embeddings": False,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
    },
    "qwen2-window": {
        "model_type": "qwen2",
        "tie_word_embeddings": False,
        "num_key_value_heads": 2,
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 1,
    },
}


def make_tokenizer(out: Path) -> Path:
    """tokenizer.json and tokenizer_config.json in `out` (a directory), trained on a
    few standard-library files."""
    from lmforge.data.corpus import stdlib_files
    from lmforge.data.tokenizer import EOS_TOKEN, tokenizer_files, train_bpe

    texts = [Path(f).read_text(errors="replace") for f in stdlib_files()[:8]]
    out.mkdir(parents=True, exist_ok=True)
    for name, text in tokenizer_files(train_bpe(texts, VOCAB).to_str(), EOS_TOKEN, 128).items():
        (out / name).write_text(text)
    return out


def make_hf_model(out: Path, layout: str, tokenizer_dir: Path, seed: int = 0, vocab_size: int = VOCAB):
    """A random model of `LAYOUTS[layout]`'s family saved to `out` with the tokenizer
    (whose vocabulary it must hold); returns the model. Biases and norm weights are random too (transformers starts
    them at 0 and 1, which would hide a misplaced one)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    from lmforge.data.tokenizer import EOS_TOKEN

    eos = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id(EOS_TOKEN)
    settings = dict(LAYOUTS[layout])
    config = AutoConfig.for_model(
        settings.pop("model_type"),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=vocab_size,
        max_position_embeddings=128,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        bos_token_id=eos,
        eos_token_id=eos,
        initializer_range=0.1,  # wider than the default: logits that a rounding error cannot reorder
        **settings,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return model


def word_level_tokenizer(path: Path, words: int) -> Path:
    """A word-level tokenizer.json of `words` words (and end-of-text and unknown)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "<unk>": 1} | {f"w{i}": i + 2 for i in range(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path
