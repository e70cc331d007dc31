"""Distillation end to end on the quickstart: the quickstart's trained `small` model
teaches the `tiny` preset (jobs/distill-logits.yaml), online and from the offline
top-k cache, beside the same student on cross-entropy alone and online on the same
top-k targets as the cache's, same steps and data.

Each student's final checkpoint is then measured here, by plain torch and outside
the engine, on the same held-out batches against the teacher: KL(teacher || student)
per token at temperature 1 and top-1 agreement. Prints KL(online) / KL(CE only),
target < 1, and |KL(cache) - KL(online)| / KL(online), target <= 0.10, against the
online student on the same top-k targets (and, for scale, against the dense one).

    python bench/distill_quality.py [--steps 200] [--top-k 64] [--out runs/bench-distill]

The teacher is `runs/quickstart`'s step-200 checkpoint when there is one (`make run`),
else the quickstart is trained first into `--out`. Quality, not time: one repeat.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pyarrow.parquet as pq
import torch

from lmforge import sdk
from lmforge.checkpoint.consolidate import read_checkpoint
from lmforge.checkpoint.store import CheckpointStore
from lmforge.data.manifest import read_manifest
from lmforge.distill.cache_manifest import is_built
from lmforge.models.build import build_model
from lmforge.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
KL_TARGET, CACHE_TARGET = 1.0, 0.10


def teacher_checkpoint(out: Path, steps: int) -> Path:
    """The quickstart's final checkpoint, trained first when `make run` has not been."""
    shipped = ROOT / "runs" / "quickstart" / "checkpoints" / f"step_{steps:08d}"
    if (shipped / "commit.json").is_file():
        return shipped
    spec = load_spec(ROOT / "jobs" / "quickstart.yaml", [f"output_dir={out}", f"train.max_steps={steps}"])
    sdk.train(spec, show_progress=False)
    return Path(CheckpointStore(spec.checkpoint_dir).latest().path)


def student(name: str, out: Path, teacher: Path, steps: int, extra: list[str]) -> tuple[Path, dict]:
    overrides = [
        f"name={name}",
        f"output_dir={out}",
        f"distill.teacher={teacher}",
        f"train.max_steps={steps}",
        f"checkpoint.interval={steps}",
        *extra,
    ]
    spec = load_spec(ROOT / "jobs" / "distill-logits.yaml", overrides)
    if spec.distill.cache and not is_built(spec.distill.cache):
        sdk.build_cache(spec, show_progress=False)
    summary = sdk.train(spec, show_progress=False)
    return Path(CheckpointStore(spec.checkpoint_dir).latest().path), summary


def held_out_tokens(data_path: Path, samples: int) -> torch.Tensor:
    manifest = read_manifest(str(data_path))
    held = manifest.eval
    rows = []
    for shard in held.shards:
        rows += pq.read_table(data_path / held.dir / shard.file, columns=["tokens"]).column("tokens").to_pylist()
        if len(rows) >= samples:
            break
    return torch.tensor(rows[:samples])


@torch.no_grad()
def against_teacher(teacher: torch.nn.Module, step_dir: Path, tokens: torch.Tensor, vocab: int) -> dict:
    cfg, weights, _ = read_checkpoint(step_dir)
    model = build_model(cfg, weights=weights).eval()
    kl = agree = count = 0.0
    for batch in tokens.split(8):
        inputs = batch[:, :-1]
        log_p = torch.log_softmax(teacher(inputs)[..., :vocab].double(), dim=-1)
        log_q = torch.log_softmax(model(inputs)[..., :vocab].double(), dim=-1)
        kl += (log_p.exp() * (log_p - log_q)).sum().item()
        agree += (log_p.argmax(-1) == log_q.argmax(-1)).sum().item()
        count += inputs.numel()
    return {"kl": kl / count, "top1": agree / count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--samples", type=int, default=64, help="held-out samples measured")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench-distill"))
    args = parser.parse_args()
    out = Path(args.out).resolve()
    os.chdir(ROOT)  # the job files' relative paths (the prepared data) are the repository's
    torch.set_num_threads(1)

    teacher_dir = teacher_checkpoint(out, 200)
    runs = {
        "ce-only": ["distill.kd_weight=0", "distill.ce_weight=1"],
        "online": [],
        "online-topk": [f"distill.top_k={args.top_k}"],
        "cache": [f"distill.top_k={args.top_k}", f"distill.cache={out}/teacher-cache-k{args.top_k}"],
    }
    checkpoints, summaries = {}, {}
    for name, extra in runs.items():
        checkpoints[name], summaries[name] = student(f"distill-{name}", out, teacher_dir, args.steps, extra)
        print(f"{name:11s} trained to step {summaries[name]['final_step']} in {summaries[name]['wall_seconds']:.0f} s", flush=True)

    spec = load_spec(ROOT / "jobs" / "distill-logits.yaml", [f"distill.teacher={teacher_dir}"])
    data_path = Path(spec.with_absolute_paths().data.path)
    vocab = read_manifest(str(data_path)).tokenizer.vocab_size
    cfg, weights, _ = read_checkpoint(teacher_dir)
    teacher = build_model(cfg, weights=weights).eval()
    tokens = held_out_tokens(data_path, args.samples)
    measured = {name: against_teacher(teacher, path, tokens, vocab) for name, path in checkpoints.items()}
    for name, m in measured.items():
        print(f"{name:11s} held-out KL(teacher || student) {m['kl']:.4f}, top-1 agreement {m['top1']:.3f}")
    kl_ratio = measured["online"]["kl"] / measured["ce-only"]["kl"]
    gap = lambda online: abs(measured["cache"]["kl"] - measured[online]["kl"]) / measured[online]["kl"]
    cache_gap, dense_gap = gap("online-topk"), gap("online")
    print(f"KL(online) / KL(CE only) = {kl_ratio:.3f} (target < {KL_TARGET}) {'OK' if kl_ratio < KL_TARGET else 'MISSED'}")
    print(
        f"|KL(cache) - KL(online, top-{args.top_k})| / KL(online, top-{args.top_k}) = {cache_gap:.3f} (target <= {CACHE_TARGET}) "
        f"{'OK' if cache_gap <= CACHE_TARGET else 'MISSED'}"
    )
    print(f"|KL(cache) - KL(online, dense)| / KL(online, dense) = {dense_gap:.3f} (what top-{args.top_k} targets give up)")
    (out / "quality.json").write_text(
        json.dumps(
            {"steps": args.steps, "top_k": args.top_k, "measured": measured, "kl_ratio": kl_ratio, "cache_gap": cache_gap, "dense_gap": dense_gap},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
