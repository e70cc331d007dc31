"""Prefix reuse: time to first token of prompts that share a 1k-token beginning (a
system prompt, a judge's instructions, a template), with the serving engine reusing
what a slot holds against the same engine computing every prompt whole. Both engines
hold the same model in this process; requests alternate between them one at a time,
each prompt a new tail after the shared beginning, and rounds repeat until the
ratio's spread is smaller than its distance from the target. Greedy tokens are
compared too: reuse must not change what is generated.

Target: TTFT with reuse at least 3x lower than without.

    python bench/prefix.py [--preset small] [--prefix 1024] [--tail 16] [--requests 8] [--max-repeats 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from lmforge.inference.sampling import SamplingParams
from lmforge.models.build import build_model
from lmforge.models.config import PRESETS
from lmforge.serve.engine import ContinuousBatcher, Sequence

TARGET = 3.0


def first_token(engine: ContinuousBatcher, prompt: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    """Seconds from submission to the first token, and the greedy tokens."""
    tokens, first, done = [], threading.Event(), threading.Event()
    began = time.perf_counter()
    elapsed = []

    def listen(token):
        if not first.is_set():
            elapsed.append(time.perf_counter() - began)
            first.set()
        tokens.append(token.id)
        if token.finish_reason:
            done.set()

    engine.submit(Sequence(prompt, params, listen))
    done.wait(300)
    return elapsed[0], tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--prefix", type=int, default=1024, help="tokens shared by every prompt")
    parser.add_argument("--tail", type=int, default=16, help="tokens of each prompt after the shared ones")
    parser.add_argument("--requests", type=int, default=8, help="prompts per side per round")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--max-repeats", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = PRESETS[args.preset].with_overrides(max_seq_len=max(PRESETS[args.preset].max_seq_len, args.prefix + args.tail + args.max_tokens))
    model = build_model(cfg, seed=0).eval()
    sides = {
        "reuse": ContinuousBatcher(model, frozenset(), cfg.vocab_size, 4, prefix_reuse=True),
        "whole": ContinuousBatcher(model, frozenset(), cfg.vocab_size, 4, prefix_reuse=False),
    }
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(0, cfg.vocab_size, (args.prefix,), generator=gen).tolist()
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0, stop_at_eos=False)
    for engine in sides.values():  # the shared beginning has been seen once, as a served system prompt has
        first_token(engine, shared + [1], params)
    ratios, medians, mismatches = [], {side: [] for side in sides}, 0
    for repeat in range(args.max_repeats):
        ttft = {side: [] for side in sides}
        for _ in range(args.requests):
            prompt = shared + torch.randint(0, cfg.vocab_size, (args.tail,), generator=gen).tolist()
            order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
            generated = {}
            for side in order:
                seconds, generated[side] = first_token(sides[side], prompt, params)
                ttft[side].append(seconds)
            mismatches += generated["reuse"] != generated["whole"]
        for side in sides:
            medians[side].append(statistics.median(ttft[side]))
        ratios.append(medians["whole"][-1] / medians["reuse"][-1])
        print(
            f"repeat {repeat + 1}: TTFT p50 whole {medians['whole'][-1] * 1e3:.1f} ms, reuse {medians['reuse'][-1] * 1e3:.1f} ms, {ratios[-1]:.2f}x"
        )
        if len(ratios) >= 3 and max(ratios) - min(ratios) < abs(statistics.median(ratios) - TARGET):
            break
    median = statistics.median(ratios)
    print(
        f"\n{args.preset}, {args.prefix}-token shared prefix + {args.tail}-token tails, {args.requests} prompts per side per repeat: "
        f"TTFT whole / reuse {median:.2f}x (repeats {', '.join(f'{r:.2f}' for r in ratios)}; spread {max(ratios) - min(ratios):.2f}), "
        f"target >= {TARGET}: {'met' if median >= TARGET else 'NOT met'}; greedy tokens differing: {mismatches} (target 0)"
    )


if __name__ == "__main__":
    main()
