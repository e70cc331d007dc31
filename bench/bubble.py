"""Pipeline bubble: measured vs theoretical for 1F1B and interleaved 1F1B.

Each stage's compute is a fixed sleep in forward and backward (a custom autograd
function) around a tiny linear layer, so the measurement isolates what the
schedule and the point-to-point transfers cost, with the real
torch.distributed.pipelining schedules and gloo process groups, and without
stages competing for a small machine's cores.

    bubble = 1 - (per-rank compute) / (step time)
    theory: (p-1)/(m+p-1) for 1F1B, (p-1)/(v*m+p-1) for interleaved 1F1B (v stages per rank)

    python bench/bubble.py [--forward-ms 10] [--backward-ms 20]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B


class Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepStage(nn.Module):
    def __init__(self, forward_s: float, backward_s: float):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x):
        return Sleep.apply(self.linear(x), self.forward_s, self.backward_s)


def run_rank(rank: int, world: int, port: int, virtual: int, microbatches: int, forward_s: float, backward_s: float, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    num_stages = world * virtual
    stage_ids = [rank + k * world for k in range(virtual)]
    stages = [PipelineStage(SleepStage(forward_s, backward_s), i, num_stages, torch.device("cpu")) for i in stage_ids]
    loss_fn = lambda output, target: ((output - target) ** 2).mean()
    if virtual == 1:
        schedule = Schedule1F1B(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    x, target = torch.randn(microbatches, 8), torch.randn(microbatches, 8)
    times = []
    for _ in range(4):
        dist.barrier()
        began = time.perf_counter()
        args = (x,) if rank == 0 else ()
        schedule.step(*args, target=target if num_stages - 1 in stage_ids else None)
        dist.barrier()
        times.append(time.perf_counter() - began)
    if rank == 0:
        out.put(statistics.median(times[1:]))
    dist.barrier()
    dist.destroy_process_group()


def measure(p: int, virtual: int, m: int, forward_s: float, backward_s: float) -> float:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(run_rank, args=(p, port, virtual, m, forward_s, backward_s, out), nprocs=p, start_method="spawn")
    step = out.get()
    busy = m * virtual * (forward_s + backward_s)
    return 1 - busy / step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--backward-ms", type=float, default=20.0)
    args = parser.parse_args()
    f, b = args.forward_ms / 1000, args.backward_ms / 1000
    print(f"per-stage compute per micro-batch: forward {args.forward_ms:g} ms, backward {args.backward_ms:g} ms")
    print(f"{'schedule':<18}{'p':>3}{'v':>3}{'m':>4}{'measured':>11}{'theory':>9}{'ratio':>8}")
    for p in (2, 4):
        for name, virtual in (("1f1b", 1), ("interleaved-1f1b", 2)):
            for m in (p, 2 * p, 4 * p):
                measured = measure(p, virtual, m, f, b)
                theory = (p - 1) / (virtual * m + p - 1)
                print(f"{name:<18}{p:>3}{virtual:>3}{m:>4}{measured:>11.3f}{theory:>9.3f}{measured / theory:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
