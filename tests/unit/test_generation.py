"""Generation against independent references: greedy tokens identical to transformers'
`generate(do_sample=False)` for a batch of prompts of unequal length; KV-cache decode
logits equal to a full recompute; the sampling rules equal transformers' logits
processors; seeds, stop strings, end-of-text and bad options."""

import json

import pytest
import torch

from cli import assert_clean_error, run_cli
from hf_models import VOCAB, make_hf_model, word_level_tokenizer
from lmforge.inference.generate import Generator, generate_ids
from lmforge.inference.kv_cache import KVCache
from lmforge.inference.sampling import SamplingParams, keep_top_k, keep_top_p, penalize_repeats
from lmforge.models.build import build_model
from lmforge.models.weights import open_model_dir

PROMPTS = [[11, 42, 7, 99, 3, 250, 18, 64], [5, 77, 123], [200, 9, 31, 44, 150]]  # unequal lengths: left padding
GREEDY = SamplingParams(max_new_tokens=32, temperature=0, stop_at_eos=False)


@pytest.fixture
def models(hf_llama):
    """(transformers' model, lmforge's import of it, the directory)."""
    reference, out = hf_llama
    return reference, build_model(open_model_dir(out).cfg, weights=str(out)).eval(), out


def left_padded(prompts, pad=0):
    longest = max(map(len, prompts))
    ids = torch.full((len(prompts), longest), pad)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    return ids, mask


def test_greedy_tokens_equal_transformers_generate(models):
    reference, ours, _ = models
    ids, mask = left_padded(PROMPTS)
    expected = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = generate_ids(ours, PROMPTS, GREEDY)
    for row, result in enumerate(got):
        assert result.tokens == expected[row, ids.shape[1] :].tolist(), row
        assert result.finish_reason == "length"
    assert [r.tokens for r in generate_ids(ours, PROMPTS, GREEDY, use_cache=False)] == [r.tokens for r in got]


def test_cache_decode_logits_equal_a_full_recompute(models):
    """Prefill left-padded prompts, then feed given tokens one at a time: each step's
    logits equal those of the whole unpadded sequence computed at once, and the
    reported logprobs are the model's."""
    _, model, _ = models
    follow = torch.randint(0, VOCAB, (len(PROMPTS), 12), generator=torch.Generator().manual_seed(3))
    ids, _ = left_padded(PROMPTS)
    pad = torch.tensor([ids.shape[1] - len(p) for p in PROMPTS])
    cache = KVCache(model.cfg, pad, ids.shape[1] + follow.shape[1], torch.device("cpu"))
    worst = 0.0
    with torch.no_grad():
        cache.begin(ids.shape[1])
        steps = [model(ids, cache)[:, -1]]
        cache.advance()
        for t in range(follow.shape[1] - 1):
            cache.begin(1)
            steps.append(model(follow[:, t : t + 1], cache)[:, -1])
            cache.advance()
        for row, prompt in enumerate(PROMPTS):
            whole = model(torch.cat([torch.tensor(prompt), follow[row, :-1]])[None])[0, len(prompt) - 1 :]
            worst = max(worst, (torch.stack([s[row] for s in steps]) - whole).abs().max().item())
        result = generate_ids(model, PROMPTS[:1], GREEDY)[0]
        whole = model(torch.tensor(PROMPTS[0] + result.tokens)[None])[0, len(PROMPTS[0]) - 1 : -1].log_softmax(-1)
    assert worst < 1e-5
    assert result.logprobs == pytest.approx(whole.gather(-1, torch.tensor(result.tokens)[:, None]).squeeze(-1).tolist(), abs=1e-5)


def test_sampling_rules_equal_transformers_processors():
    from transformers import RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    history = torch.randint(0, VOCAB, (4, 20), generator=gen)
    seen = torch.zeros(4, VOCAB, dtype=torch.bool).scatter_(1, history, True)
    assert torch.equal(penalize_repeats(logits, seen, 1.3), RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone()))
    scaled = TemperatureLogitsWarper(0.7)(history, logits.clone())
    assert torch.equal(keep_top_k(scaled, 17), TopKLogitsWarper(17)(history, scaled.clone()))
    for p in (0.05, 0.5, 0.9):
        assert torch.equal(keep_top_p(scaled, p), TopPLogitsWarper(p)(history, scaled.clone())), p


@pytest.fixture(scope="module")
def text_model(tmp_path_factory, hf_tokenizer):
    out = tmp_path_factory.mktemp("text-model")
    make_hf_model(out, "untied-gqa", hf_tokenizer, seed=1)
    return out


@pytest.fixture(scope="module")
def generator(text_model):
    return Generator.load(str(text_model))


def test_a_seed_repeats_a_sample_and_top_k_1_is_greedy(generator):
    prompts = ["def main(", "import os\n"]
    sample = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95, seed=5, stop_at_eos=False)
    first, again = generator.generate(prompts, sample), generator.generate(prompts, sample)
    assert [r.tokens for r in first] == [r.tokens for r in again]
    other = generator.generate(prompts, SamplingParams(max_new_tokens=16, seed=6, stop_at_eos=False))
    assert [r.tokens for r in other] != [r.tokens for r in first]
    greedy = generator.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0, stop_at_eos=False))
    top1 = generator.generate(prompts, SamplingParams(max_new_tokens=16, top_k=1, seed=9, stop_at_eos=False))
    assert [r.tokens for r in top1] == [r.tokens for r in greedy]


def test_stop_strings_and_end_of_text_end_a_sequence(generator):
    free = generator.generate(["class A:"], SamplingParams(max_new_tokens=24, temperature=0, stop_at_eos=False))[0]
    stop = generator.tokenizer.decode(free.tokens[5:7])
    assert stop and stop in free.text
    cut = generator.generate(["class A:"], SamplingParams(max_new_tokens=24, temperature=0, stop=[stop], stop_at_eos=False))[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop)]
    assert cut.tokens == free.tokens[: len(cut.tokens)] and len(cut.tokens) <= 7
    # The 4th greedy token as the end-of-text token: the sequence ends there, with it.
    ended = generate_ids(
        generator.model,
        [generator.tokenizer.encode("class A:").ids],
        SamplingParams(max_new_tokens=24, temperature=0),
        eos_ids=frozenset({free.tokens[3]}),
    )[0]
    assert ended.finish_reason == "stop" and ended.tokens == free.tokens[: free.tokens.index(free.tokens[3]) + 1]


def test_generate_on_the_command_line_and_its_refusals(generator, text_model, tmp_path):
    model = str(text_model)
    result = run_cli(
        "generate", model, "--prompt", "def f(", "--prompt", "x = ", "--temperature", "0", "--max-new-tokens", "5", "--json", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["def f(", "x = "] and all(len(line["tokens"]) <= 5 for line in lines)
    expected = generator.generate(["def f(", "x = "], SamplingParams(max_new_tokens=5, temperature=0))
    assert [line["tokens"] for line in lines] == [r.tokens for r in expected]
    refusals = [
        (["--max-new-tokens", "0"], "--max-new-tokens: must be at least 1, got 0"),
        (["--top-p", "1.5"], "--top-p: must be in (0, 1], got 1.5"),
        (["--top-p", "0"], "--top-p: must be in (0, 1]"),
        (["--temperature", "-1"], "--temperature: must be from 0 (greedy) to 100, got -1.0"),
        (["--temperature", "nan"], "--temperature: must be from 0 (greedy) to 100, got nan"),
        (["--repetition-penalty", "nan"], "--repetition-penalty: must be from 0.01 to 100 (1 is none), got nan"),
        (["--repetition-penalty", "1e-39"], "--repetition-penalty: must be from 0.01 to 100"),
        (["--seed", str(2**64)], "--seed: must be from 0 to 2**63-1, got 18446744073709551616"),
        (
            ["--max-new-tokens", "127"],
            f"--prompt: {len(generator.tokenizer.encode('def f(').ids)} prompt tokens and max_new_tokens 127 "
            "exceed the model's context of 128 tokens",
        ),
    ]
    big = tmp_path / "big-tokenizer.json"
    word_level_tokenizer(big, generator.model.cfg.vocab_size + 10)
    refusals.append(
        (
            ["--tokenizer", str(big)],
            f"--tokenizer: the tokenizer has {generator.model.cfg.vocab_size + 12} tokens, more than the "
            f"model's vocabulary of {generator.model.cfg.vocab_size}",
        )
    )
    for args, message in refusals:
        assert_clean_error(run_cli("generate", model, "--prompt", "def f(", *args, cwd=tmp_path), message)
    assert_clean_error(run_cli("generate", str(tmp_path / "nowhere"), "--prompt", "x", cwd=tmp_path), "MODEL:", "does not exist")
