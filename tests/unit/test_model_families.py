"""The released models' presets: each parameter count equals the one its publisher
states, and transformers, building the exported config.json on the meta device,
gets the same architecture and count (nothing is downloaded or materialized)."""

import pytest
import torch

from lmforge.errors import UserError
from lmforge.models import Transformer
from lmforge.models.build import build_model
from lmforge.models.config import PRESETS, config_from_dict
from lmforge.models.hf_config import ARCHITECTURES, config_from_hf, config_to_hf
from lmforge.spec import spec_from_dict

# Exact counts from the model cards' safetensors totals, or (value, digits) where the
# card states only a rounded figure (Qwen3's "1.7B", "4.0B", "14.8B", "32.8B").
PUBLISHED = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352,
    "qwen2.5-72b": 72_706_203_648,
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": (1.7e9, 0.1e9),
    "qwen3-4b": (4.0e9, 0.1e9),
    "qwen3-8b": 8_190_735_360,
    "qwen3-14b": (14.8e9, 0.1e9),
    "qwen3-32b": (32.8e9, 0.1e9),
    "mistral-7b": 7_248_023_552,
    "gemma-3-1b": 999_885_952,
    "qwen3-30b-a3b": 30_532_122_624,
}


# Gemma 3's larger models ship with a vision tower: their technical report's table gives
# the language model's parameters apart from the embedding, in millions.
NON_EMBEDDING_MILLIONS = {"gemma-3-1b": 698, "gemma-3-4b": 3_209, "gemma-3-12b": 10_759, "gemma-3-27b": 25_600}


@pytest.mark.parametrize("name", PUBLISHED)
def test_a_presets_parameter_count_is_the_published_one(name):
    count, published = PRESETS[name].num_params(), PUBLISHED[name]
    if isinstance(published, tuple):
        assert abs(count - published[0]) <= published[1] / 2, count
    else:
        assert count == published


@pytest.mark.parametrize("name", NON_EMBEDDING_MILLIONS)
def test_gemmas_language_models_have_the_published_counts(name):
    cfg = PRESETS[name]
    assert round((cfg.num_params() - cfg.vocab_size * cfg.dim) / 1e6) == NON_EMBEDDING_MILLIONS[name]


@pytest.mark.parametrize("name", sorted(set(PUBLISHED) | set(NON_EMBEDDING_MILLIONS)))
def test_transformers_builds_the_same_model_from_the_exported_config(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = PRESETS[name]
    exported = config_to_hf(cfg, eos_id=0, dtype="bfloat16")
    assert config_from_hf(exported, name) == cfg  # every switch survives the round trip
    config = AutoConfig.for_model(**{k: v for k, v in exported.items() if k != "architectures"})
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(config)
        ours = Transformer(cfg)
    assert type(theirs).__name__ == ARCHITECTURES[cfg.family]  # what transformers chose from model_type
    assert sum(p.numel() for p in theirs.parameters()) == cfg.num_params() == sum(p.numel() for p in ours.parameters())


@pytest.mark.parametrize("method, bound", [("int8", 0.05), ("int4", 0.15)])
def test_quantized_blocks_keep_qwens_biases_and_norms(method, bound):
    """torchao's int4 Linear has no bias: the biases are kept beside it. Quantized
    logits stay near fp32's and move when a bias does (a dropped bias would not)."""
    from lmforge.models.quantized import quantize_blocks

    cfg = PRESETS["tiny"].with_overrides(qkv_bias=True, qk_norm=True, head_dim=32)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))

    def logits(bias_shift: float) -> torch.Tensor:
        model = build_model(cfg, seed=3).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.copy_(torch.linspace(-0.5, 0.5, param.numel()) + bias_shift)
            full = model(tokens)
            quantize_blocks(model, method, group_size=32)
            return full, model(tokens)

    full, quantized = logits(0.0)
    _, shifted = logits(0.3)
    assert (quantized - full).abs().max() < bound * full.abs().max()
    assert (shifted - quantized).abs().max() > 1e-3


def test_a_jobs_model_switches_and_their_refusals():
    job = {"name": "x", "data": {"path": "/nowhere"}, "model": {"preset": "tiny", "family": "qwen3", "head_dim": 24, "qk_norm": True}}
    cfg = spec_from_dict(job).model_arch
    assert (cfg.family, cfg.head_dim, cfg.qk_norm, cfg.qkv_bias) == ("qwen3", 24, True, False)
    assert config_from_dict(cfg.as_dict(), "x") == cfg
    assert "head_dim" not in PRESETS["tiny"].as_dict()  # a plain Llama's config reads as it always has
    assert spec_from_dict(job | {"model": {"preset": "qwen3-0.6b", "dim": 512}}).model_arch.head_dim == 128  # stated, kept
    assert spec_from_dict(job | {"model": {"preset": "tiny", "dim": 128}}).model_arch.head_dim == 32  # derived, follows dim
    with pytest.raises(UserError, match="model.family: Input should be 'llama', 'qwen2', 'qwen3', 'mistral', 'gemma3_text' or 'qwen3_moe'"):
        spec_from_dict(job | {"model": {"family": "gemma"}})
    moe = {"preset": "tiny", "n_experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 32}
    with pytest.raises(UserError, match="model.n_experts: a mixture of experts trains with data and pipeline parallelism"):
        spec_from_dict(job | {"model": moe, "parallel": {"tp": 2}, "resources": {"workers": 2}})
    with pytest.raises(ValueError, match="rope_scaling kind is 'yarn'"):
        config_from_dict(PRESETS["tiny"].as_dict() | {"rope_scaling": {"kind": "yarn", "factor": 2.0}}, "x")


QUANTIZED_PARTS = {
    "gemma3": {
        "qk_norm": True, "head_dim": 32, "sliding_window": 8, "full_attention_layers": (0,), "unit_offset_norms": True,
        "sandwich_norms": True, "activation": "gelu_tanh", "embed_scale": True, "query_pre_attn_scalar": 20.0, "local_rope_theta": 5000.0,
    },
    "experts": {"n_experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 48, "normalize_top_k": True, "dense_layers": (1,)},
}  # fmt: skip


@pytest.mark.parametrize("parts", QUANTIZED_PARTS)
def test_every_familys_parts_quantize(parts):
    """int8: the quantized model computes what the fp32 model computes with each block
    projection's weights rounded as stored (Gemma's norms and scales, the router and
    every expert included: nothing else changed); int4 stays near fp32 (Gemma's
    post-branch norms give its rounding the residual's scale: 0.22 of the logits'
    norm measured, 0.04 without them)."""
    from lmforge.models.quantized import quantize_blocks

    cfg = PRESETS["tiny"].with_overrides(**QUANTIZED_PARTS[parts])
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    quantized, rounded, int4 = (build_model(cfg, seed=3).eval() for _ in range(3))
    with torch.no_grad():
        full = int4(tokens)
        quantize_blocks(quantized, "int8", group_size=32)
        stored = dict(quantized.layers.named_modules())
        linears = {name: m for name, m in rounded.layers.named_modules() if isinstance(m, torch.nn.Linear)}
        for name, linear in linears.items():
            linear.weight.copy_(stored[name].weight.dequantize())
        assert torch.allclose(quantized(tokens), rounded(tokens), rtol=0, atol=1e-5 * full.abs().max().item())
        quantize_blocks(int4, "int4", group_size=32)
        assert (int4(tokens) - full).norm() < 0.3 * full.norm()
    assert len(linears) == (14 if parts == "gemma3" else 24)  # 7 per block; with experts: their 4 x 3 and a router
