"""Distillation's cost: the step time of the student alone, of the teacher's forward
alone, of an online distillation step (teacher forward + student step + KD loss)
and of a step from the offline teacher cache (the student step + top-k KD loss on
stored targets), in one run; prints KD / (student + teacher forward), target <= 1.1,
cached KD / student, target <= 1.15, and the cache's bytes per token at k = 128. A
LoRA student's online KD step (`model.lora`, rank `--lora-rank` on every linear layer
of the blocks) is a side too: its ratio to the full student's KD step is printed (no
target: the issue asks for the measurement).

One rank (a gloo group of one), the native engine, the same synthetic batches for
every side. The teacher is the `small` preset and the student `tiny` at the same
vocabulary, both seeded. The cached side's targets are the teacher's top-k of the
same batches, stored as the cache stores them (int32 ids, fp16 log-probabilities)
and converted per step as the trainer does; the bytes are one Parquet shard of them
written by the cache's own writer. Sides take turns batch by batch, timed in this
process's CPU time (the machine is shared), and repeats go on until the spread of
each ratio's repeats is smaller than its distance from its target (at most
`--max-repeats`); the verdict is the median's, or "unsettled".

    python bench/distill.py [--steps 10] [--loss forward_kl] [--ce-weight 0] [--chunk-tokens 1024] [--compile] [--k 128]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
import torch.distributed as dist

from lmforge.data.manifest import Shard
from lmforge.distill.losses import teacher_log_probs
from lmforge.distill_jobs.teacher_cache import write_shard
from lmforge.engines import create_engine
from lmforge.models import PRESETS
from lmforge.models.build import build_model
from lmforge.models.weights import write_model_dir
from lmforge.parallel.mesh import build_mesh
from lmforge.parallel.shape import MeshShape
from lmforge.ray_runtime import tune_process
from lmforge.spec import spec_from_dict
from lmforge.trainer import job_loss

VOCAB, SEQ, MICRO, ACCUM = 8192, 128, 4, 2
TARGET, CACHED_TARGET, BYTES_TARGET = 1.1, 1.15, 350


def job(args, teacher_dir: str | None, cache: str | None = None, lora: bool = False) -> dict:
    base = {
        "name": "bench-distill",
        "model": {"preset": "tiny", "vocab_size": VOCAB},
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "train": {"global_batch": MICRO * ACCUM, "micro_batch": MICRO, "seq_len": SEQ, "max_steps": 10_000},
        "data": {"path": "unused"},
        "parallel": {"compile": args.compile},
    }
    if teacher_dir:
        base["distill"] = {
            "teacher": teacher_dir,
            "loss": args.loss,
            "temperature": 2.0,
            "ce_weight": args.ce_weight,
            "chunk_tokens": args.chunk_tokens,
        }
    if cache:
        base["distill"] |= {"cache": cache, "top_k": args.k}
    if lora:
        base["model"]["lora"] = {"rank": args.lora_rank, "alpha": 2 * args.lora_rank}
    return base


@torch.no_grad()
def stored_targets(teacher, data: list[torch.Tensor], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The teacher's top-k of each batch at the temperature, as the cache stores them."""
    stored = []
    for batch in data:
        logits = torch.stack([teacher(micro[:, :-1]) for micro in batch])
        values, ids = teacher_log_probs(logits, 2.0, VOCAB).topk(k, dim=-1)
        stored.append((ids.to(torch.int32).numpy(), values.to(torch.float16).numpy()))
    return stored


def cache_bytes_per_token(stored: list[tuple[np.ndarray, np.ndarray]], directory: str) -> float:
    ids = np.concatenate([i.reshape(-1, SEQ * i.shape[-1]) for i, _ in stored])
    logprobs = np.concatenate([v.reshape(-1, SEQ * v.shape[-1]) for _, v in stored])
    path = Path(directory) / "shard.parquet"
    write_shard(
        path,
        {"sample_id": np.arange(len(ids)), "topk_ids": ids, "topk_logprobs": logprobs},
        Shard(file=path.name, first_sample_id=0, num_samples=len(ids)),
    )
    return path.stat().st_size / (len(ids) * SEQ)


def batches(count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (ACCUM, MICRO, SEQ + 1), generator=gen) for _ in range(count)]


def timed(sides: dict, data) -> dict[str, float]:
    """Seconds of this process's CPU time per batch of each side, the sides taking turns
    batch by batch (so that a slower spell of a shared machine falls on all of them).
    CPU time: one thread computes, so this is the work done, not the time other tenants
    took from it."""
    spent = dict.fromkeys(sides, 0.0)
    for batch in data:
        for name, side in sides.items():
            began = time.process_time()
            side(batch)
            spent[name] += time.process_time() - began
    return {name: total / len(data) for name, total in spent.items()}


def settled(ratios: list[float], target: float) -> bool:
    """Whether the repeats' spread is smaller than the median's distance from the target,
    so that the verdict would be the same at any repeat."""
    return max(ratios) - min(ratios) < abs(statistics.median(ratios) - target)


def verdict(ratios: list[float], target: float) -> str:
    median = statistics.median(ratios)
    said = ("met" if median <= target else "NOT met") if settled(ratios, target) else "unsettled: the spread is wider than the margin"
    return f"{median:.3f} (median; repeats {min(ratios):.3f}-{max(ratios):.3f}); target <= {target}: {said}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per side per repeat")
    parser.add_argument("--loss", default="forward_kl")
    parser.add_argument("--ce-weight", type=float, default=0.0, help="the student alone trains on cross-entropy; 0: KD replaces it")
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--compile", action="store_true", help="parallel.compile for every side (the forward KL loss compiled too)")
    parser.add_argument("--k", type=int, default=128, help="the cached side's top-k")
    parser.add_argument("--lora-rank", type=int, default=8, help="the LoRA student's rank")
    parser.add_argument("--min-repeats", type=int, default=4)
    parser.add_argument("--max-repeats", type=int, default=10)
    args = parser.parse_args()
    tune_process(int(os.environ["OMP_NUM_THREADS"]))  # as a rank process is
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    device = torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        teacher_cfg = PRESETS["small"].with_overrides(vocab_size=VOCAB)
        teacher_dir = f"{tmp}/teacher"
        write_model_dir(teacher_dir, "lmforge", teacher_cfg, build_model(teacher_cfg, seed=7).state_dict())
        student_spec, distill_spec = (spec_from_dict(job(args, t)) for t in (None, teacher_dir))
        dims = build_mesh(device.type, MeshShape.for_spec(student_spec.parallel))
        student = create_engine(student_spec, dims, device)
        distilled = create_engine(distill_spec, dims, device, job_loss(distill_spec))
        cached_spec = spec_from_dict(job(args, teacher_dir, cache=f"{tmp}/cache"))
        cached = create_engine(cached_spec, dims, device, job_loss(cached_spec))
        lora_spec = spec_from_dict(job(args, teacher_dir, lora=True))
        lora = create_engine(lora_spec, dims, device, job_loss(lora_spec))
        teacher = distilled.loss.teachers[0]
        data = batches(args.steps)
        stored = stored_targets(teacher, data, args.k)
        bytes_per_token = cache_bytes_per_token(stored, tmp)
    by_batch = {id(batch): targets for batch, targets in zip(data, stored)}

    def cached_step(batch):
        ids, logprobs = by_batch[id(batch)]  # converted as the trainer converts what the feed read
        cached.train_step(batch, loss_inputs=cached.loss.step_inputs(0, None, (ids, logprobs)))

    @torch.no_grad()
    def teacher_forward(batch):
        for micro in batch:
            teacher(micro[:, :-1])

    sides = {
        "student alone": student.train_step,
        "teacher forward alone": teacher_forward,
        "online KD step": distilled.train_step,
        "cached KD step": cached_step,
        "LoRA student KD step": lora.train_step,
    }
    timed(sides, data[:2])  # warm-up: allocator, first-call costs
    seconds = {name: [] for name in sides}
    ratios: list[float] = []
    cached_ratios: list[float] = []
    lora_ratios: list[float] = []
    while len(ratios) < args.max_repeats:
        for name, spent in timed(sides, data).items():
            seconds[name].append(spent)
        ratios.append(seconds["online KD step"][-1] / (seconds["student alone"][-1] + seconds["teacher forward alone"][-1]))
        cached_ratios.append(seconds["cached KD step"][-1] / seconds["student alone"][-1])
        lora_ratios.append(seconds["LoRA student KD step"][-1] / seconds["online KD step"][-1])
        if len(ratios) >= args.min_repeats and settled(ratios, TARGET) and settled(cached_ratios, CACHED_TARGET):
            break
    tokens = MICRO * ACCUM * SEQ
    print(
        f"student: tiny ({student_spec.model_arch.num_params():,} params), teacher: small ({teacher_cfg.num_params():,} params), "
        f"vocab {VOCAB}; {args.loss}, ce_weight {args.ce_weight}, chunk {args.chunk_tokens} tokens, compile {args.compile}; {tokens} tokens per step, 1 rank, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{len(ratios)} repeats of {args.steps} steps per side, sides interleaved")
    for name, times in seconds.items():
        print(f"  {name:22s} {statistics.median(times) * 1000:8.1f} ms/step  ({tokens / statistics.median(times):,.0f} tokens/s)")
    print(f"  KD / (student + teacher forward): {verdict(ratios, TARGET)}")
    print(f"  cached KD (top-{args.k}) / student: {verdict(cached_ratios, CACHED_TARGET)}")
    print(
        f"  LoRA (rank {args.lora_rank}) KD / full KD: {statistics.median(lora_ratios):.3f} (median; repeats {min(lora_ratios):.3f}-{max(lora_ratios):.3f})"
    )
    print(
        f"  cache: {bytes_per_token:.1f} bytes per token at k = {args.k} (dense bf16 logits: {2 * VOCAB:,}); "
        f"target <= {BYTES_TARGET}: {'met' if bytes_per_token <= BYTES_TARGET else 'NOT met'}"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
