"""LoRA students (`model.lora`): the model unchanged at step 0, only the adapters
trainable and counted by the formula, merged weights equal to the adapters applied,
and peft's own LoRA on transformers' model (the independent reference) giving our
logits from the PEFT export. Layouts are the parity launches' (tests/integration)."""

import re

import pytest
import torch

from hf_models import make_hf_model
from lmforge.memory.states import deepspeed_states, lora_parameters, native_states
from lmforge.models import PRESETS, build_model
from lmforge.models.lora import LoraLinear, apply_lora, merged, quantize_nf4
from lmforge.models.lora_config import LoraSpec, nf4_bytes, nf4_scaler_block
from lmforge.models.peft_format import write_peft_dir
from lmforge.models.weights import open_model_dir
from lmforge.spec import spec_from_dict

MOE = PRESETS["tiny"].with_overrides(n_experts=4, experts_per_token=2, expert_ffn_hidden=24, dense_layers=(1,))


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(5))


def moved(model: torch.nn.Module) -> torch.nn.Module:
    """B drawn at random, as after training (B = 0 would hide every mistake in it)."""
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_b"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return model


@pytest.mark.parametrize("cfg", [PRESETS["tiny"], MOE], ids=["dense", "experts"])
def test_the_model_is_unchanged_at_step_zero_and_only_adapters_train(cfg):
    model = build_model(cfg, seed=3).eval()
    batch = tokens(cfg.vocab_size)
    with torch.no_grad():
        before = model(batch)
    lora = LoraSpec(rank=4, targets=["q_proj", "wv", "w2"])
    adapted = apply_lora(model, lora, seed=3)
    with torch.no_grad():
        assert torch.equal(model(batch), before)  # B = 0: exactly the base model
    assert adapted == sum(2 + (cfg.n_experts if cfg.has_experts(i) else 1) for i in range(cfg.n_layers))  # wq, wv and each w2
    trainable = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}
    assert all(name.endswith(("lora_a", "lora_b")) for name in trainable)
    # r * (in + out) per adapted layer: wq (dim -> heads x head_dim), wv (dim -> kv heads x head_dim), w2 (hidden -> dim)
    per_block = 4 * (cfg.dim + cfg.n_heads * cfg.head_dim) + 4 * (cfg.dim + cfg.n_kv_heads * cfg.head_dim)
    w2 = sum(
        4 * (cfg.dim + cfg.expert_ffn_hidden) * cfg.n_experts if cfg.has_experts(i) else 4 * (cfg.dim + cfg.ffn_hidden) for i in range(cfg.n_layers)
    )
    assert sum(trainable.values()) == cfg.n_layers * per_block + w2


def test_merged_weights_give_the_adapted_model():
    cfg = PRESETS["tiny"]
    model = build_model(cfg, seed=0).eval()
    lora = LoraSpec(rank=8, alpha=32)
    apply_lora(model, lora, seed=0)
    moved(model)
    batch = tokens(cfg.vocab_size)
    plain = build_model(cfg, weights=merged(model.state_dict(), lora)).eval()
    with torch.no_grad():
        adapted, folded = model(batch), plain(batch)
    assert (adapted - folded).abs().max().item() < 1e-5
    assert not torch.allclose(adapted, build_model(cfg, seed=0)(batch), atol=1e-3)


def test_the_adapters_are_every_layouts(tmp_path):
    """Drawn per name from the seed: a pipeline stage or another rank gets the same A."""
    cfg = PRESETS["tiny"]
    one, other = build_model(cfg, seed=1), build_model(cfg, seed=1)
    del other.layers["0"]
    apply_lora(one, LoraSpec(), seed=1)
    apply_lora(other, LoraSpec(), seed=1)
    assert torch.equal(one.layers["1"].attention.wk.lora_a, other.layers["1"].attention.wk.lora_a)
    assert isinstance(one.layers["1"].feed_forward.w3, LoraLinear) and one.layers["1"].feed_forward.w3.lora_a.abs().max() > 0


@pytest.mark.parametrize("layout", ["qwen2", "qwen3"])
def test_peft_applies_the_export_as_we_do(layout, tmp_path, hf_tokenizer):
    """q/k/v biases and tied embeddings (Qwen2), q/k norms and a head_dim of its own
    (Qwen3): the rotary permutation reaches B's rows, and peft, on transformers' own
    model, computes our adapted logits."""
    from peft import PeftModel

    reference = make_hf_model(tmp_path / "base", layout, hf_tokenizer)
    source = open_model_dir(tmp_path / "base")
    ours = build_model(source.cfg, weights=str(tmp_path / "base")).eval()
    lora = LoraSpec(rank=4, alpha=8, targets=["wq", "wk", "wv", "wo", "w1", "w2", "w3"])
    apply_lora(ours, lora, seed=0)
    moved(ours)
    adapters = {name: p.detach() for name, p in ours.named_parameters() if name.endswith(("lora_a", "lora_b"))}
    write_peft_dir(tmp_path / "adapter", source.cfg, lora, adapters, torch.float32, str(tmp_path / "base"))
    batch = tokens(source.cfg.vocab_size)
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(reference, tmp_path / "adapter").eval()(batch).logits
        assert (ours(batch) - peft_logits).abs().max().item() < 1e-5


def test_the_plan_counts_gradients_and_moments_of_the_adapters_alone():
    base = {"name": "t", "data": {"path": "unused"}, "model": {"preset": "tiny"}}
    full = native_states(spec_from_dict(base), 0)
    low_rank = native_states(spec_from_dict(base, ["model.lora={rank: 4}"]), 0)
    cfg = PRESETS["tiny"]
    adapters = (
        cfg.n_layers
        * 4
        * ((cfg.dim + cfg.n_heads * cfg.head_dim) * 2 + (cfg.dim + cfg.n_kv_heads * cfg.head_dim) * 2 + 3 * (cfg.dim + cfg.ffn_hidden))
    )
    assert low_rank.params == full.params + 4 * adapters
    assert low_rank.grads == 4 * adapters
    assert low_rank.optimizer == 2 * 4 * adapters + 4 * cfg.n_layers * 7 * 2  # two fp32 moments, a step per tensor


def test_deepspeed_plans_count_the_adapters_as_all_that_trains():
    """The ZeRO paper's accounting with psi split: every weight in 16-bit (or fp32) and
    partitioned at stage 3, gradients and the fp32 master + moments of the adapters only."""
    cfg, lora = PRESETS["tiny"], LoraSpec(rank=4)
    adapters = lora_parameters(cfg, lora)
    psi = cfg.num_params() + adapters
    for stage in (2, 3):
        states = deepspeed_states(cfg, 2, "bf16", stage, lora=lora)
        assert states.params == (2 * psi if stage == 2 else psi)
        assert states.grads == (adapters + 2 * adapters if stage == 2 else 2 * adapters)
        assert states.optimizer == 6 * adapters


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.lora={quantize: nf4}", "model.init_from=HERE", "parallel.tp=2"],
            "an NF4 base trains with the native engine under data and pipeline",
        ),
        (["model.lora={quantize: nf4}", "model.init_from=HERE"], "the w1 layers (172 x 64) do not split into NF4 blocks of 64 weights"),
    ],
)
def test_an_nf4_base_that_cannot_be_held_alike_on_every_layout_is_refused(overrides, message, tmp_path):
    from lmforge.errors import UserError
    from lmforge.models.weights import write_model_dir

    write_model_dir(tmp_path / "base", "lmforge", PRESETS["tiny"], build_model(PRESETS["tiny"]).state_dict())
    job = {"name": "t", "data": {"path": "unused"}, "model": {"preset": "tiny"}, "train": {"micro_batch": 2, "global_batch": 4}}
    with pytest.raises(UserError, match=re.escape(message)):
        spec_from_dict(job, [item.replace("HERE", str(tmp_path / "base")) for item in overrides])


def test_nf4_blocks_split_alike_over_up_to_eight_shards():
    """QLoRA's 256 scalers per group where a layer allows it; fewer on a small one, so
    that a weight's groups still split over 1, 2, 4 or 8 FSDP ranks."""
    assert nf4_scaler_block(4096 * 4096) == 256
    assert nf4_scaler_block(64 * 64) == 8  # 64 scalers: 8 groups of 8
    assert nf4_scaler_block(172 * 64) is None and nf4_scaler_block(100) is None
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    nf4 = quantize_nf4(weight)
    assert nf4.scaler_block_size == 8 and (nf4.get_original_weight() - weight).abs().max() < 0.5 * weight.abs().max()
    assert sum(getattr(nf4, name).numel() * getattr(nf4, name).element_size() for name in nf4.__tensor_flatten__()[0]) == nf4_bytes(64 * 64)
