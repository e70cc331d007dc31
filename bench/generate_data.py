"""Instruction distillation's generation throughput: new tokens/s of the teacher
answering prompts at batch 1 against batch 16 inside one actor, and with 1 against 2
actors in the Ray Data pipeline of `lmforge distill generate`, in one run; prints the
ratios (targets: batch 16 >= 4x batch 1; 2 actors >= 1.6x one actor on 2 cores).

The teacher is the `small` preset with seeded weights and a BPE trained on a few
stdlib files; the prompts are the first lines of stdlib files. Every answer is
exactly `--new-tokens` long (no end-of-text stop), so the sides do the same work.
Inside an actor the sides are timed in this process's CPU time (one thread computes),
taking turns; the actor sides run the real pipeline (`answered_units`) and count the
steady state: from each pool's first unit written to its last, the tokens of the
units after the first (the start-up of the actors and their models is reported
apart). Repeats go on until each ratio's spread is smaller than its distance from its
target (at most `--max-repeats`); the verdict is the median's, or "unsettled".

    python bench/generate_data.py [--prompts 384] [--new-tokens 32] [--max-repeats 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_DATA_LOG_LEVEL", "WARNING")  # not every pipeline run at INFO

import ray
import torch

from lmforge.data.corpus import stdlib_files
from lmforge.data.tokenizer import EOS_TOKEN, train_bpe
from lmforge.distill_jobs.instruct.build import answered_units, plan_generation
from lmforge.inference.generate import generate_ids
from lmforge.inference.sampling import SamplingParams
from lmforge.models import PRESETS
from lmforge.models.build import build_model
from lmforge.models.weights import write_model_dir
from lmforge.ray_runtime import tune_process
from lmforge.spec import spec_from_dict

TARGETS = {"batch 16 / batch 1": 4.0, "2 actors / 1 actor": 1.6}


def teacher_and_prompts(tmp: Path, count: int) -> tuple[Path, Path]:
    files = stdlib_files()
    tokenizer = train_bpe([Path(f).read_text(errors="replace") for f in files[:20]], 1024)
    cfg = PRESETS["small"].with_overrides(vocab_size=1024)
    teacher = tmp / "teacher"
    write_model_dir(teacher, "lmforge", cfg, build_model(cfg, seed=0).state_dict(), files={"tokenizer.json": tokenizer.to_str()})
    lines = [line.strip()[:48] for f in files for line in Path(f).read_text(errors="replace").splitlines()[:40] if len(line.strip()) > 12]
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": line}) + "\n" for line in lines[:count]))
    assert EOS_TOKEN in tokenizer.get_vocab()
    return teacher, prompts


def job(tmp: Path, teacher: Path, prompts: Path, new_tokens: int, actors: int) -> dict:
    generate = {"max_new_tokens": new_tokens, "temperature": 1.0, "n": 1, "seed": 0, "batch_size": 16}
    return {
        "name": "bench-generate-data",
        "output_dir": str(tmp / "runs"),
        "model": {"preset": "tiny", "vocab_size": 1024},
        "train": {"global_batch": 16, "micro_batch": 16, "seq_len": 128, "max_steps": 1},
        "data": {"path": str(tmp / f"answers-{actors}")},
        "tracking": {"enabled": False},
        "distill": {
            "teacher": str(teacher),
            "kd_weight": 0,
            "ce_weight": 1.0,
            "instruct": {"prompts": str(prompts), "prompts_per_shard": 16, "actors": actors, "generate": generate},
        },
    }


def pool_throughput(tmp: Path, spec) -> tuple[float, float]:
    """(steady-state new tokens/s, seconds to the first unit written) of one pipeline run."""
    plan = plan_generation(spec)
    work = tmp / f"work-{spec.distill.instruct.actors}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    began = time.perf_counter()
    stamps = [(time.perf_counter(), tokens) for _, tokens in answered_units(spec, plan, work, list(range(len(plan.units))))]
    first = min(spec.distill.instruct.actors, len(stamps))  # each actor's first unit carries its start-up
    steady = sum(tokens for _, tokens in stamps[first:]) / max(stamps[-1][0] - stamps[first - 1][0], 1e-9)
    return steady, stamps[0][0] - began


def in_actor(model, prompts: list[list[int]], new_tokens: int, batch: int) -> float:
    """New tokens/s (CPU time) answering `prompts` `batch` at a time."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop_at_eos=False)
    began = time.process_time()
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        generate_ids(model, chunk, params, row_seeds=list(range(start, start + len(chunk))))
    return len(prompts) * new_tokens / (time.process_time() - began)


def settled(ratios: list[float], target: float) -> bool:
    return max(ratios) - min(ratios) < abs(statistics.median(ratios) - target)


def verdict(ratios: list[float], target: float) -> str:
    median = statistics.median(ratios)
    said = ("met" if median >= target else "NOT met") if settled(ratios, target) else "unsettled: the spread is wider than the margin"
    return f"{median:.2f} (median; repeats {min(ratios):.2f}-{max(ratios):.2f}); target >= {target}: {said}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=384)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--min-repeats", type=int, default=3)
    parser.add_argument("--max-repeats", type=int, default=8)
    args = parser.parse_args()
    tune_process(1)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        teacher, prompts = teacher_and_prompts(tmp, args.prompts)
        specs = {actors: spec_from_dict(job(tmp, teacher, prompts, args.new_tokens, actors)) for actors in (1, 2)}
        plan = plan_generation(specs[1])
        prompt_ids = [ids for unit in plan.units for _, _, ids in unit][:64]
        model = build_model(PRESETS["small"].with_overrides(vocab_size=1024), seed=0).eval()
        measured: dict[str, list[float]] = {name: [] for name in ("batch 1", "batch 16", "1 actor", "2 actors")}
        startup: dict[int, list[float]] = {1: [], 2: []}
        ratios: dict[str, list[float]] = {name: [] for name in TARGETS}
        while len(ratios["batch 16 / batch 1"]) < args.max_repeats:
            for batch in (1, 16):
                measured[f"batch {batch}"].append(in_actor(model, prompt_ids, args.new_tokens, batch))
            for actors in (1, 2):
                steady, first = pool_throughput(tmp, specs[actors])
                measured[f"{actors} actor{'s' if actors > 1 else ''}"].append(steady)
                startup[actors].append(first)
            ratios["batch 16 / batch 1"].append(measured["batch 16"][-1] / measured["batch 1"][-1])
            ratios["2 actors / 1 actor"].append(measured["2 actors"][-1] / measured["1 actor"][-1])
            if len(ratios["2 actors / 1 actor"]) >= args.min_repeats and all(settled(ratios[n], t) for n, t in TARGETS.items()):
                break
    ray.shutdown()
    print(
        f"teacher: small ({PRESETS['small'].with_overrides(vocab_size=1024).num_params():,} params), {args.prompts} prompts, "
        f"{args.new_tokens} new tokens each, {torch.get_num_threads()} thread per actor; {len(ratios['2 actors / 1 actor'])} repeats, sides interleaved"
    )
    for name, values in measured.items():
        print(f"  {name:9s} {statistics.median(values):8,.0f} new tokens/s")
    print(
        f"  time to the first unit written (actors and models starting): 1 actor {statistics.median(startup[1]):.1f} s, "
        f"2 actors {statistics.median(startup[2]):.1f} s"
    )
    for name, target in TARGETS.items():
        print(f"  {name}: {verdict(ratios[name], target)}")


if __name__ == "__main__":
    main()
