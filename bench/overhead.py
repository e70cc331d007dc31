"""Framework overhead on one rank: lmforge's trainer vs a hand-written PyTorch loop.

Both train the same model from the same init on the same batches (the samples
lmforge's feed picks, read straight from the shards for the baseline) with the
same AdamW, schedule and clipping; the losses are checked equal, then tokens/s
are compared. Runs alternate A/B several times and the medians are compared,
since machines here are shared and noisy.

    python bench/overhead.py [--steps 100] [--warmup 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pyarrow.parquet as pq
import ray
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lmforge.data.corpus import stdlib_files
from lmforge.data.order import BatchLayout, GlobalOrder
from lmforge.data.prepare import prepare_dataset
from lmforge.data.prepare_options import PrepareOptions
from lmforge.engines.base import warmup_cosine
from lmforge.events import Event, Step
from lmforge.models import build_model
from lmforge.spec import spec_from_dict
from lmforge.trainer import Trainer


def job(workdir: str, data: str, steps: int) -> dict:
    return {
        "name": "overhead",
        "output_dir": workdir,
        "model": {"preset": "small", "vocab_size": 4096},
        "parallel": {"dp": 1},
        "optim": {"lr": 1e-3, "warmup_steps": 5},
        "train": {"global_batch": 8, "micro_batch": 4, "seq_len": 128, "max_steps": steps, "seed": 0},
        "data": {"path": data, "prefetch_steps": 32},
        "checkpoint": {"interval": 10_000, "resume": False},
        "tracking": {"enabled": False},
    }


def run_lmforge(spec, manifest, warmup: int) -> tuple[float, list[float]]:
    events: list[Event] = []
    Trainer(spec, manifest, report=events.append).run()
    steps = [e for e in events if isinstance(e, Step)]
    timed = steps[warmup:]
    tokens = spec.train.global_batch * spec.train.seq_len * len(timed)
    return tokens / sum(e.step_time for e in timed), [e.loss for e in steps]


def load_batches(spec, manifest) -> list[torch.Tensor]:
    """The exact samples lmforge trains on, in order, fully in memory."""
    table = pq.read_table([os.path.join(spec.data.path, s.file) for s in manifest.shards])
    tokens = table.column("tokens").combine_chunks().flatten().to_numpy().reshape(-1, spec.train.seq_len + 1)
    order = GlobalOrder(manifest.num_samples, spec.train.seed, block=manifest.shard_samples, window=spec.data.shuffle_window)
    layout = BatchLayout(spec.train.global_batch, spec.train.micro_batch, 1)
    batches = []
    for step in range(spec.train.max_steps):
        ids = order.ids(*layout.rank_positions(step, 0))
        batches.append(torch.from_numpy(tokens[ids].astype(np.int64)).view(layout.accum, layout.micro_batch, -1))
    return batches


def run_baseline(spec, batches, warmup: int) -> tuple[float, list[float]]:
    model = build_model(spec.model_arch, seed=spec.train.seed)
    o = spec.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(o.warmup_steps, spec.decay_steps, o.min_lr_ratio))
    times, losses = [], []
    for micro_batches in batches:
        began = time.perf_counter()
        total = 0.0
        for batch in micro_batches:
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()) / len(micro_batches)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        times.append(time.perf_counter() - began)
        losses.append(total)
    tokens = spec.train.global_batch * spec.train.seq_len * len(times[warmup:])
    return tokens / sum(times[warmup:]), losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as work:
        corpus = os.path.join(work, "corpus")
        os.makedirs(corpus)
        for i, path in enumerate(stdlib_files()[::8][:200]):
            with open(path, "rb") as src, open(os.path.join(corpus, f"{i:04d}.py"), "wb") as dst:
                dst.write(src.read())
        data = os.path.join(work, "data")
        manifest = prepare_dataset(PrepareOptions(source=corpus, out=data, seq_len=128, vocab_size=4096, show_progress=False))
        spec = spec_from_dict(job(work, data, args.steps))
        batches = load_batches(spec, manifest)
        ours, base = [], []
        for repeat in range(args.repeats):
            run_spec = spec_from_dict(job(os.path.join(work, f"run{repeat}"), data, args.steps))
            tps, lm_losses = run_lmforge(run_spec, manifest, args.warmup)
            ours.append(tps)
            tps, ref_losses = run_baseline(spec, batches, args.warmup)
            base.append(tps)
        same = np.allclose(lm_losses, ref_losses, rtol=1e-5)
    dist.destroy_process_group()
    ray.shutdown()
    ratio = statistics.median(ours) / statistics.median(base)
    print(
        f"model: small ({spec.model_arch.num_params() / 1e6:.2f}M params), {args.steps} steps x {spec.train.global_batch * spec.train.seq_len} tokens, 1 rank, 1 thread"
    )
    print(f"losses identical to the hand-written loop: {same}")
    print(f"hand-written loop : {statistics.median(base):10,.0f} tokens/s  (runs: {', '.join(f'{t:,.0f}' for t in base)})")
    print(f"lmforge trainer   : {statistics.median(ours):10,.0f} tokens/s  (runs: {', '.join(f'{t:,.0f}' for t in ours)})")
    print(f"ratio lmforge / hand-written: {ratio:.3f}  (target >= 0.97)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
