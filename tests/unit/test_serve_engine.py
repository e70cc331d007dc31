"""Continuous batching against generation of each sequence alone (`generate_ids`, the
reference tested against transformers): sequences that join while others decode,
leave at different lengths, share at most `max_running` slots, and sample from their
own seeds produce exactly what each would alone; a cancelled sequence frees its slot."""

import threading
import time

import pytest

from lmforge.inference.generate import generate_ids
from lmforge.inference.sampling import SamplingParams
from lmforge.models.build import build_model
from lmforge.models.config import PRESETS
from lmforge.serve.engine import ContinuousBatcher, Sequence

PROMPTS = [[11, 42, 7, 99, 3, 250, 18, 64], [5, 77, 123], [200, 9, 31, 44, 150], [1, 2], [300, 301, 302, 303, 304, 305]]


# Plain, and with a sliding window shorter than the generations on all but layer 0
# (the slots' window mask against generate_ids', itself checked against transformers).
# The tiny model; with a sliding window on its second layer; as a mixture of experts (Qwen3-MoE's routing).
LAYOUTS = {
    "full": {},
    "window": {"sliding_window": 6, "full_attention_layers": (0,)},
    "experts": {"n_experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 48, "normalize_top_k": True},
}


@pytest.fixture(scope="module", params=list(LAYOUTS.values()), ids=list(LAYOUTS))
def model(request):
    return build_model(PRESETS["tiny"].with_overrides(**request.param), seed=5).eval()


class Listener:
    def __init__(self, then=None):
        self.tokens, self.logprobs, self.finish, self.then = [], [], None, then
        self.done = threading.Event()

    def __call__(self, token):
        self.tokens.append(token.id)
        self.logprobs.append(token.logprob)
        if len(self.tokens) == 2 and self.then:  # from the engine's thread: the next joins mid-decode
            self.then()
        if token.finish_reason:
            self.finish = token.finish_reason
            self.done.set()


def settled(engine) -> tuple[int, int]:
    """The engine's counts once its step has ended: a sequence leaves its slot just after
    its last token is told, so the listener may wake first."""
    deadline = time.time() + 10
    while engine.counts != (0, 0) and time.time() < deadline:
        time.sleep(0.01)
    return engine.counts


def run_chained(engine, params_of, seeds):
    """Each prompt submitted when the one before has its second token, so every later
    sequence arrives while earlier ones are decoding (no timing involved)."""
    listeners = []
    for prompt, params, seed in reversed(list(zip(PROMPTS, params_of, seeds))):
        after = listeners[0] if listeners else None
        listener = Listener(None if after is None else (lambda seq=after.sequence: engine.submit(seq)))
        listener.sequence = Sequence(prompt, params, listener, seed=seed)
        listeners.insert(0, listener)
    engine.submit(listeners[0].sequence)
    for listener in listeners:
        assert listener.done.wait(60)
    return listeners


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_joining_and_leaving_sequences_generate_what_each_would_alone(model, temperature):
    # Different lengths: sequences leave at different steps while others keep going.
    params_of = [SamplingParams(max_new_tokens=n, temperature=temperature, top_k=50, stop_at_eos=False) for n in (40, 7, 25, 60, 3)]
    seeds = [100 + i for i in range(len(PROMPTS))]
    sizes = []
    engine = ContinuousBatcher(model, frozenset(), model.cfg.vocab_size, max_running=3, on_step=sizes.append)
    got = run_chained(engine, params_of, seeds)
    for prompt, params, seed, listener in zip(PROMPTS, params_of, seeds, got):
        alone = generate_ids(model, [prompt], params, row_seeds=[seed])[0]
        assert listener.tokens == alone.tokens
        assert listener.finish == "length"
        assert listener.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    assert max(sizes) == 3, "the bound on running sequences was never reached, or exceeded"
    assert settled(engine) == (0, 0) and sorted(engine.free) == [0, 1, 2]


def test_end_of_text_and_stop_end_a_sequence_early(model):
    greedy = SamplingParams(max_new_tokens=30, temperature=0)
    alone = generate_ids(model, [PROMPTS[0]], greedy)[0].tokens
    engine = ContinuousBatcher(model, frozenset({alone[4]}), model.cfg.vocab_size, max_running=2)
    eos, stopped = Listener(), Listener()
    engine.submit(Sequence(PROMPTS[0], greedy, eos))
    engine.submit(
        Sequence(
            PROMPTS[0], SamplingParams(max_new_tokens=30, temperature=0, stop_at_eos=False), stopped, stopped=lambda tokens: tokens[-1] == alone[2]
        )
    )
    assert eos.done.wait(30) and stopped.done.wait(30)
    assert (eos.tokens, eos.finish) == (alone[:5], "stop")
    assert (stopped.tokens, stopped.finish) == (alone[:3], "stop")


def test_a_cancelled_sequence_leaves_and_frees_its_slot(model):
    engine = ContinuousBatcher(model, frozenset(), model.cfg.vocab_size, max_running=1)
    long, after = Listener(), Listener()
    seq = Sequence(PROMPTS[1], SamplingParams(max_new_tokens=200, temperature=0, stop_at_eos=False), long)
    engine.submit(seq)
    while len(long.tokens) < 3:
        time.sleep(0.005)
    engine.cancel(seq)
    # The one slot is free again: a later sequence is served, and exactly as alone.
    params = SamplingParams(max_new_tokens=5, temperature=0)
    engine.submit(Sequence(PROMPTS[2], params, after))
    assert after.done.wait(30)
    assert after.tokens == generate_ids(model, [PROMPTS[2]], params)[0].tokens
    assert len(long.tokens) < 200 and long.finish is None
    assert settled(engine) == (0, 0) and engine.free == [0]


def test_a_sequence_that_fails_ends_alone_and_the_others_are_untouched(model):
    """One sequence's own settings fail: at its admission (a seed torch cannot take),
    in a decode step it shares with another (a penalty that makes its probabilities
    NaN, set after its second token), and in its stop check. Each ends with an error
    token; the sequence beside them generates exactly what it would alone."""
    params = SamplingParams(max_new_tokens=30, temperature=0.9, top_k=50, stop_at_eos=False)
    engine = ContinuousBatcher(model, frozenset(), model.cfg.vocab_size, max_running=4)
    steady, unseedable, poisoned, stop_fails = Listener(), Listener(), Listener(), Listener()

    def poison():
        poisoned.sequence.params.repetition_penalty = 1e-39  # logits / 1e-39: infinities, then NaN probabilities

    poisoned.then = poison
    poisoned.sequence = Sequence(PROMPTS[1], SamplingParams(max_new_tokens=30, temperature=0.9, stop_at_eos=False), poisoned, seed=3)
    stop_fails.sequence = Sequence(PROMPTS[2], params, stop_fails, seed=4, stopped=lambda tokens: 1 / (len(tokens) - 3) > 0)
    engine.submit(Sequence(PROMPTS[0], params, steady, seed=1))
    engine.submit(Sequence(PROMPTS[3], params, unseedable, seed=2**64))
    engine.submit(poisoned.sequence)
    engine.submit(stop_fails.sequence)
    for listener in (steady, unseedable, poisoned, stop_fails):
        assert listener.done.wait(60)
    assert unseedable.finish.startswith("error: ValueError: Overflow") and unseedable.tokens == [-1]
    assert poisoned.finish.startswith("error:") and len(poisoned.tokens) == 3  # two tokens, then the error
    assert stop_fails.finish.startswith("error: ZeroDivisionError") and len(stop_fails.tokens) == 3
    assert (steady.tokens, steady.finish) == (generate_ids(model, [PROMPTS[0]], params, row_seeds=[1])[0].tokens, "length")
    assert settled(engine) == (0, 0) and sorted(engine.free) == [0, 1, 2, 3]


def test_a_prompt_beginning_that_a_slot_holds_is_reused_and_generates_what_it_would_alone(model):
    """Prefix reuse: a prompt sharing a system prompt with a sequence still decoding
    (copied from its slot), the previous turn with its answer and a new message (the
    freed slot's prompt and generation), the same prompt again sampled with another
    seed (another choice of one request: all but its last token). Each
    generates exactly what it would alone; the engine reports what it reused, and
    reuses nothing where it is told not to."""
    system = [11, 42, 7, 99, 3, 250, 18, 64, 5, 77, 123, 9]
    greedy = SamplingParams(max_new_tokens=12, temperature=0, stop_at_eos=False)
    sampled = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, stop_at_eos=False)
    prefills = []
    engine = ContinuousBatcher(model, frozenset(), model.cfg.vocab_size, max_running=3, on_prefill=lambda *counts: prefills.append(counts))

    def run(prompt, params, seed=0, then=None):
        listener = Listener(then)
        listener.sequence = Sequence(prompt, params, listener, seed=seed)
        return listener

    asked = run(system + [200, 9, 31], greedy)
    decoding = run(
        system + [44, 150], SamplingParams(max_new_tokens=40, temperature=0, stop_at_eos=False), then=lambda: engine.submit(asked.sequence)
    )
    engine.submit(decoding.sequence)
    assert decoding.done.wait(30) and asked.done.wait(30)
    turn = asked.sequence.prompt + asked.tokens + [300, 301]
    follow_up = run(turn, greedy)
    engine.submit(follow_up.sequence)
    assert follow_up.done.wait(30)
    again = run(asked.sequence.prompt, sampled, seed=7)
    engine.submit(again.sequence)
    assert again.done.wait(30)
    for listener in (decoding, asked, again, follow_up):
        alone = generate_ids(model, [listener.sequence.prompt], listener.sequence.params, row_seeds=[listener.sequence.seed])[0]
        assert listener.tokens == alone.tokens
        assert listener.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    prompt = len(asked.sequence.prompt)
    assert prefills == [(len(system) + 2, 0), (prompt, len(system)), (len(turn), prompt + len(asked.tokens) - 1), (prompt, prompt - 1)]

    prefills.clear()
    plain = ContinuousBatcher(
        model, frozenset(), model.cfg.vocab_size, max_running=1, prefix_reuse=False, on_prefill=lambda *counts: prefills.append(counts)
    )
    for listener in (run(asked.sequence.prompt, greedy), run(asked.sequence.prompt, greedy)):
        plain.submit(listener.sequence)
        assert listener.done.wait(30) and listener.tokens == asked.tokens
    assert prefills == [(prompt, 0), (prompt, 0)]
