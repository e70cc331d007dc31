"""A serving replica's memory: the KV cache of a full-context sequence, as transformers
itself caches it for the same model (GQA's fewer key-value heads, Qwen3's own
head_dim), the weights beside it, and the slots a replica's memory gives."""

import dataclasses

import pytest
import torch

from lmforge.errors import UserError
from lmforge.memory.serving import serving_memory, size_slots
from lmforge.models.config import PRESETS
from lmforge.models.hf_config import config_to_hf

CONTEXT = 24
FAMILIES = {
    "llama with GQA": dataclasses.replace(PRESETS["tiny"], vocab_size=128, max_seq_len=64),
    "qwen3 with its own head_dim": dataclasses.replace(PRESETS["tiny"], vocab_size=128, max_seq_len=64, family="qwen3", qk_norm=True, head_dim=24),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_sequences_kv_cache_is_what_transformers_caches(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = FAMILIES[family]
    exported = config_to_hf(cfg, eos_id=0, dtype="float32")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{k: v for k, v in exported.items() if k != "architectures"}))
    with torch.no_grad():
        cache = model(torch.randint(0, 128, (1, CONTEXT)), use_cache=True).past_key_values
    cached = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    plan = serving_memory(cfg, "fp32", sequences=3, context=CONTEXT)
    assert plan.kv_per_sequence == cached and plan.kv_cache == 3 * cached
    assert plan.weights == 4 * sum(p.numel() for p in model.parameters()) and plan.total == plan.weights + 3 * cached
    assert serving_memory(cfg, "bf16", 1, CONTEXT).kv_per_sequence == cached // 2


def test_slots_are_sized_by_the_memory_and_a_replica_that_holds_none_is_refused():
    plan = serving_memory(PRESETS["qwen2.5-0.5b"], "bf16", sequences=16)  # 32k positions: 0.38 GiB a sequence
    weights, one = plan.weights, plan.kv_per_sequence
    assert size_slots(plan, int((weights + 5.5 * one) / 0.9), "--memory-per-replica") == 5
    assert size_slots(plan, 10**12, "--memory-per-replica") == 16  # never more than asked
    with pytest.raises(UserError, match=r"^--memory-per-replica: 1.00 GiB \(90% usable\) cannot hold the weights \(0.92 GiB\) and one"):
        size_slots(plan, 2**30, "--memory-per-replica")
