"""The Llama-style model: shapes, parameter count, causality, meta-device build."""

import pytest
import torch

from lmforge.models import PRESETS, Transformer, build_model


def test_forward_shape_and_param_count():
    cfg = PRESETS["tiny"]
    model = build_model(cfg, seed=0)
    logits = model(torch.randint(0, cfg.vocab_size, (3, 17)))
    assert logits.shape == (3, 17, cfg.vocab_size)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_grouped_query_attention_shapes():
    cfg = PRESETS["tiny"]
    model = build_model(cfg)
    attn = model.layers["0"].attention
    assert attn.wk.weight.shape == (cfg.n_kv_heads * cfg.head_dim, cfg.dim)
    assert attn.wq.weight.shape == (cfg.n_heads * cfg.head_dim, cfg.dim)


def test_tied_embeddings_share_storage_and_count_once():
    cfg = PRESETS["tiny"].with_overrides(tie_embeddings=True)
    model = build_model(cfg)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_causal_future_tokens_do_not_change_the_past():
    cfg = PRESETS["tiny"]
    model = build_model(cfg, seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % cfg.vocab_size
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[0, :8], b[0, :8], atol=1e-6)
    assert not torch.allclose(a[0, 8:], b[0, 8:])


def test_init_is_deterministic_per_seed():
    cfg = PRESETS["tiny"]
    a, b, c = build_model(cfg, seed=1), build_model(cfg, seed=1), build_model(cfg, seed=2)
    assert torch.equal(a.layers["1"].feed_forward.w2.weight, b.layers["1"].feed_forward.w2.weight)
    assert not torch.equal(a.layers["1"].feed_forward.w2.weight, c.layers["1"].feed_forward.w2.weight)


@pytest.mark.parametrize("name", ["1b", "7b", "13b", "70b"])
def test_large_presets_build_on_meta_without_memory(name):
    cfg = PRESETS[name]
    with torch.device("meta"):
        model = Transformer(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_preset_sizes_are_the_published_ones():
    assert round(PRESETS["7b"].num_params() / 1e9, 1) == 6.7
    assert round(PRESETS["70b"].num_params() / 1e9) == 69
