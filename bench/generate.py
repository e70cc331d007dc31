"""Generation speed: new tokens/s at batch 1 and 8 for lmforge with its KV cache,
lmforge recomputing the whole sequence at every step, and transformers' `generate`
on the same exported model and prompts, with the ratios.

The model is a Hugging Face directory both sides load: `--model` (anything lmforge
opens; exported with `--format hf` first), or else the `small` preset with seeded
weights. Every side generates exactly `--new-tokens` greedy tokens (no end-of-text
stop), and the sides' tokens are checked to agree before any number is printed.
Sides alternate within each repeat, and repeats go on until the spread of each
ratio's repeats is smaller than its distance from the target (at most
`--max-repeats`), since machines here are shared and noisy.

    python bench/generate.py [--model PATH] [--new-tokens 256] [--batches 1,8] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from lmforge.inference.generate import generate_ids
from lmforge.inference.sampling import SamplingParams
from lmforge.models.build import build_model
from lmforge.models.config import PRESETS
from lmforge.models.weights import open_model_dir
from seeded_model import seeded_model

TARGETS = {"cache / recompute": 5.0, "lmforge / transformers": 1.0}  # the second at the largest batch


def hf_directory(args, tmp: Path) -> Path:
    """The model as a Hugging Face directory."""
    from lmforge.checkpoint.export import export_model

    if args.model:
        out = tmp / "hf"
        export_model(args.model, out, fmt="hf")
        return out
    return seeded_model(tmp / "hf", PRESETS["small"], "hf")


def prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 16 to 31 tokens: a batch pads them to the longest."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (16 + int(torch.randint(0, 16, (1,), generator=gen)),), generator=gen).tolist() for _ in range(batch)]


def run_transformers(model, batch: list[list[int]], new_tokens: int, device: str) -> list[list[int]]:
    longest = max(map(len, batch))
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(batch):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[:, longest:].tolist()


def timed(fn) -> tuple[float, list]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    began = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - began, result


def settled(ratios: list[float], target: float, min_repeats: int) -> bool:
    return len(ratios) >= min_repeats and max(ratios) - min(ratios) < abs(statistics.median(ratios) - target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a checkpoint, lmforge export or Hugging Face directory (default: the small preset, seeded)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--min-repeats", type=int, default=4)
    parser.add_argument("--max-repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = hf_directory(args, Path(tmp))
        cfg = open_model_dir(path).cfg
        ours = build_model(cfg, args.device, weights=str(path)).eval()
        theirs = AutoModelForCausalLM.from_pretrained(path).to(args.device).eval()
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0, stop_at_eos=False)
    sides = {
        "lmforge (KV cache)": lambda b: [g.tokens for g in generate_ids(ours, b, params)],
        "lmforge (recompute)": lambda b: [g.tokens for g in generate_ids(ours, b, params, use_cache=False)],
        "transformers generate": lambda b: run_transformers(theirs, b, args.new_tokens, args.device),
    }
    print(
        f"model: {cfg.n_layers} layers, dim {cfg.dim}, vocab {cfg.vocab_size} ({path if args.model else 'small preset, seeded'}); "
        f"{args.new_tokens} new tokens, greedy; device {args.device}, {torch.get_num_threads()} threads"
    )
    largest = max(int(b) for b in args.batches.split(","))
    with torch.no_grad():
        for size in (int(b) for b in args.batches.split(",")):
            batch = prompts(size, cfg.vocab_size)
            seconds: dict[str, list[float]] = {name: [] for name in sides}
            ratios: dict[str, list[float]] = {name: [] for name in TARGETS}
            tokens = {}
            while len(seconds["lmforge (KV cache)"]) < args.max_repeats:
                for name, side in sides.items():
                    took, tokens[name] = timed(lambda: side(batch))
                    seconds[name].append(took)
                assert tokens["lmforge (KV cache)"] == tokens["lmforge (recompute)"] == tokens["transformers generate"], "the sides disagree"
                cache, recompute, hf = (seconds[n][-1] for n in sides)
                ratios["cache / recompute"].append(recompute / cache)
                ratios["lmforge / transformers"].append(hf / cache)
                if all(settled(r, TARGETS[name], args.min_repeats) for name, r in ratios.items()):
                    break
            print(f"\nbatch {size}: {len(seconds['lmforge (KV cache)'])} repeats, sides interleaved")
            for name, times in seconds.items():
                print(f"  {name:24s} {size * args.new_tokens / statistics.median(times):9.1f} new tokens/s (median of {len(times)})")
            for name, r in ratios.items():
                verdict = ""
                if size == largest or name == "cache / recompute":
                    verdict = f"  target >= {TARGETS[name]:g}x: {'met' if min(r) >= TARGETS[name] else 'NOT met'} (every repeat)"
                print(f"  {name:24s} {statistics.median(r):6.2f}x (repeats {min(r):.2f}-{max(r):.2f}){verdict}")


if __name__ == "__main__":
    main()
