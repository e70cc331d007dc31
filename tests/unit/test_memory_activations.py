"""The activation estimate against the bytes a real forward keeps for backward:
within 10% over several shapes, with no, full and every-k-th-block checkpointing
(one process, fp32). Op-level selective checkpointing caches its tensors where
saved-tensor hooks do not see them, so it is measured as what the forward leaves
allocated (the profiler's memory events), less the logits it returns."""

import pytest
import torch

from lmforge.memory.activations import Shape, kv_cache_bytes, stage_bytes
from lmforge.models.build import build_model
from lmforge.models.config import ModelConfig
from lmforge.parallel.checkpointing import apply_activation_checkpointing

SHAPES = [
    # (dim, heads, kv heads, ffn, layers, micro-batch, seq)
    (64, 4, 2, 172, 2, 2, 32),
    (96, 6, 6, 256, 3, 1, 64),
    (128, 8, 2, 344, 4, 3, 16),
]


def model_for(dim, heads, kv, ffn, layers):
    cfg = ModelConfig(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, vocab_size=512, ffn_hidden=ffn, max_seq_len=128)
    return cfg, build_model(cfg)


def _fixed_storages(model) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}


def saved_for_backward(model, tokens) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves in the forward."""
    fixed, seen = _fixed_storages(model), {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in fixed:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens)
    return sum(seen.values())


@pytest.mark.parametrize("dims", SHAPES)
@pytest.mark.parametrize("mode,every", [("none", 1), ("full", 1), ("selective", 2)])
def test_activation_estimate_matches_saved_tensors(dims, mode, every):
    *arch, micro, seq = dims
    cfg, model = model_for(*arch)
    apply_activation_checkpointing(model, mode, every)
    measured = saved_for_backward(model, torch.randint(0, 512, (micro, seq)))
    estimated = stage_bytes(cfg, Shape(micro, seq), cfg.n_layers, first=True, last=True, mode=mode, every=every)
    assert estimated == pytest.approx(measured, rel=0.10), (measured, estimated)


def held_after_forward(model, tokens) -> int:
    """Bytes the forward allocated and did not free, less its output: everything kept
    for backward, caches included."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(tokens)
    return sum(event.self_cpu_memory_usage for event in prof.events()) - out.numel() * out.element_size()


@pytest.mark.parametrize("dims", SHAPES)
def test_op_level_checkpointing_estimate_matches_what_the_forward_holds(dims):
    *arch, micro, seq = dims
    cfg, model = model_for(*arch)
    tokens = torch.randint(0, 512, (micro, seq))
    assert held_after_forward(model, tokens) == pytest.approx(saved_for_backward(model, tokens), rel=0.01)  # the method agrees with the hooks
    apply_activation_checkpointing(model, "selective", "op")
    measured = held_after_forward(model, tokens)
    estimated = stage_bytes(cfg, Shape(micro, seq), cfg.n_layers, first=True, last=True, mode="selective", every="op")
    assert estimated == pytest.approx(measured, rel=0.10), (measured, estimated)
    assert measured < saved_for_backward(model_for(*arch)[1], tokens)  # it does keep less than no checkpointing


def test_checkpointing_modes_order_as_expected():
    cfg = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=14336)
    shape = Shape(1, 8192, dtype_bytes=2)
    none, op, full = (stage_bytes(cfg, shape, 32, True, True, mode, every) for mode, every in (("none", 1), ("selective", "op"), ("full", 1)))
    assert full < op < none
    tp = Shape(1, 8192, tp=8, sequence_parallel=True, dtype_bytes=2)
    assert stage_bytes(cfg, tp, 32, True, True) < none / 4  # SP splits nearly everything


def test_kv_cache_formula():
    cfg = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=14336)
    # 2 x 1 x 8192 x 32 layers x 8 kv heads x 128 x 2 bytes = 1 GiB
    assert kv_cache_bytes(cfg, batch=1, seq_len=8192) == 2**30
    assert kv_cache_bytes(cfg, batch=4, seq_len=8192, tp=8) == 2**29
