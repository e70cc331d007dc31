"""LoRA adapters served per request: PEFT directories read back into lmforge's names,
and requests for different adapters (and the base) decoding in one continuous batch,
each generating exactly what its merged model generates alone; a prompt's cached
beginning reused under its own adapter only."""

import threading

import pytest
import torch

from lmforge.inference.adapters import attach_adapters
from lmforge.inference.generate import generate_ids
from lmforge.inference.sampling import SamplingParams
from lmforge.models import PRESETS, build_model
from lmforge.models.lora import apply_lora, merged
from lmforge.models.lora_config import LoraSpec
from lmforge.models.peft_format import read_peft_dir, write_peft_dir
from lmforge.serve.backend import _prompt_logits
from lmforge.serve.engine import ContinuousBatcher, Sequence

CFG = PRESETS["tiny"].with_overrides(qkv_bias=True)  # Qwen2's biases: B's rows permuted with q and k's
SPECS = {"code": LoraSpec(rank=4, alpha=8), "chat": LoraSpec(rank=2, alpha=6, targets=["q_proj", "down_proj"])}


def adapted(spec: LoraSpec, seed: int) -> dict[str, torch.Tensor]:
    """A trained-looking LoRA state of the base (seed 5): A as drawn, B random."""
    model = build_model(CFG, seed=5)
    apply_lora(model, spec, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_b"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the base with both adapters attached from their PEFT directories, {name: merged model})."""
    tmp = tmp_path_factory.mktemp("adapters")
    states = {name: adapted(spec, seed) for (name, spec), seed in zip(SPECS.items(), (1, 2))}
    adapters = []
    for name, spec in SPECS.items():
        factors = {k: v for k, v in states[name].items() if k.endswith(("lora_a", "lora_b"))}
        write_peft_dir(tmp / name, CFG, spec, factors, torch.float32, None)
        adapters.append(read_peft_dir(tmp / name, CFG))
    model = build_model(CFG, seed=5).eval()
    attach_adapters(model, adapters)
    return model, {name: build_model(CFG, weights=merged(states[name], SPECS[name])).eval() for name in SPECS}


def test_a_peft_directory_reads_back_as_written(tmp_path):
    spec = SPECS["chat"]
    state = adapted(spec, 3)
    factors = {k: v for k, v in state.items() if k.endswith(("lora_a", "lora_b"))}
    write_peft_dir(tmp_path / "a", CFG, spec, factors, torch.float32, None)
    read = read_peft_dir(tmp_path / "a", CFG)
    assert (read.rank, read.scaling) == (2, 3.0)
    assert sorted(read.factors) == sorted(factors) and all(torch.equal(read.factors[k], factors[k]) for k in factors)
    with pytest.raises(
        ValueError,
        match="adapter_model.safetensors: base_model.model.model.layers.0.\\S+ has shape \\[2, [0-9]+\\], this model needs \\[2, [0-9]+\\]",
    ):
        read_peft_dir(tmp_path / "a", CFG.with_overrides(dim=96, ffn_hidden=256))
    (tmp_path / "a" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 6, "target_modules": ["c_attn"]}')
    with pytest.raises(ValueError, match="adapter_config.json: target_modules \\['c_attn'\\]"):
        read_peft_dir(tmp_path / "a", CFG)


def test_adapters_and_the_base_decode_together_as_their_merged_models(served):
    model, merged_models = served
    prompt = [11, 42, 7, 99, 3, 250, 18, 64, 5]
    # The same prompt under each adapter and the base: no slot's cached prefix crosses adapters.
    asks = [(prompt, 0, model), (prompt, 1, merged_models["code"]), (prompt, 2, merged_models["chat"]), ([5, 77, 123, 9], 1, merged_models["code"])]
    params = SamplingParams(max_new_tokens=10, temperature=0, stop_at_eos=False)
    prefills = []
    engine = ContinuousBatcher(model, frozenset(), CFG.vocab_size, max_running=4, on_prefill=lambda *counts: prefills.append(counts))
    results = [([], threading.Event()) for _ in asks]
    for (tokens, adapter, _), (got, done) in zip(asks, results):

        def emit(token, got=got, done=done):
            got.append(token.id)
            if token.finish_reason:
                done.set()

        engine.submit(Sequence(tokens, params, emit, adapter=adapter))
    for (tokens, _, reference), (got, done) in zip(asks, results):
        assert done.wait(60)
        assert got == generate_ids(reference, [tokens], params)[0].tokens
    assert [reused for _, reused in prefills] == [0, 0, 0, 0], "a prefix cached under one adapter served another"
    alone = {tuple(got) for got, _ in results[:3]}
    assert len(alone) == 3, "the adapters changed nothing"
    with torch.no_grad():
        for adapter, reference in ((1, merged_models["code"]), (2, merged_models["chat"])):
            echoed = _prompt_logits(model, prompt, adapter)
            assert (echoed - reference(torch.tensor([prompt]))[0, :-1]).abs().max() < 1e-5
