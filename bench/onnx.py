"""Decode speed with ONNX Runtime against lmforge's eager PyTorch path, on this CPU: one
model (the `small` preset with seeded weights, or `--model`) exported by
`lmforge export --format onnx` as fp32 and int4, each side generating the same greedy
tokens after the same prompt, end-of-text ignored, one thread. Sides alternate within
each repeat, and repeats go on until each ratio's spread is under a tenth of it.

    python bench/onnx.py [--model DIR] [--tokens 128] [--max-repeats 7]
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

from lmforge.inference.generate import Generator, generate_ids
from lmforge.inference.onnx_runtime import OnnxGenerator, export_onnx, timed_decode
from lmforge.inference.sampling import SamplingParams
from lmforge.models.config import PRESETS
from seeded_model import seeded_model

PROMPT = "def read_config(path):\n    "


def small_model(tmp: Path) -> Path:
    return seeded_model(tmp / "small", PRESETS["small"].with_overrides(family="qwen2", qkv_bias=True))


def eager_seconds(generator: Generator, tokens: int) -> float:
    ids = generator.tokenizer.encode(PROMPT).ids
    params = SamplingParams(max_new_tokens=tokens, temperature=0, stop_at_eos=False)
    began = time.perf_counter()
    with torch.inference_mode():
        generate_ids(generator.model, [ids], params, frozenset(), generator.tokenizer.get_vocab_size())
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="any model lmforge opens (default: the small preset, seeded)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--max-repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = Path(args.model) if args.model else small_model(tmp)
        for precision in ("fp32", "int4"):
            export_onnx(str(model), str(tmp / f"onnx-{precision}"), precision)
        eager = Generator.load(str(model))
        onnx = {p: OnnxGenerator(str(tmp / f"onnx-{p}")) for p in ("fp32", "int4")}
        sides = {
            "eager": lambda: eager_seconds(eager, args.tokens),
            **{f"ort-{p}": (lambda g=generator: timed_decode(g, PROMPT, args.tokens)) for p, generator in onnx.items()},
        }
        for run in sides.values():  # warm: first calls allocate and plan
            run()
        rates: dict[str, list[float]] = {side: [] for side in sides}
        ratios: dict[str, list[float]] = {"ort-fp32 / eager": [], "ort-int4 / eager": []}
        for repeat in range(args.max_repeats):
            order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
            for side in order:
                rates[side].append(args.tokens / sides[side]())
            for name in ratios:
                ratios[name].append(rates[name.split(" / ")[0]][-1] / rates["eager"][-1])
            print(f"repeat {repeat + 1}: " + ", ".join(f"{side} {values[-1]:.0f} tok/s" for side, values in rates.items()), flush=True)
            if repeat >= 2 and all(max(v) - min(v) < 0.1 * statistics.median(v) for v in ratios.values()):
                break
        print(
            f"\n{model.name}, {args.tokens} greedy tokens after a {len(PROMPT)}-character prompt, one thread, medians of {len(rates['eager'])} repeats:"
        )
        for side, values in rates.items():
            print(f"  {side:<9} {statistics.median(values):8.1f} tok/s")
        for name, values in ratios.items():
            print(f"  {name}: {statistics.median(values):.2f}x (repeats {', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
