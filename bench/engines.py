"""Native FSDP2 (ZeRO-3) vs DeepSpeed ZeRO-3 on the same job: tokens/s and peak
memory per rank, with ratios.

Both engines train the same model from the same init on the same synthetic
batches, on 2 ranks (gloo on CPU, NCCL on GPUs); their losses are checked to
agree before any number is printed. Engines alternate over several repeats and
medians are compared, since machines here are shared and noisy. Peak memory is
the CUDA allocator's peak on GPUs, and the process's peak resident set on CPU
(which includes the Python and library footprint both sides share).

    python bench/engines.py [--preset small] [--steps 20] [--repeats 3] [--offload]
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lmforge.engines import create_engine
from lmforge.parallel.mesh import build_mesh
from lmforge.parallel.shape import MeshShape
from lmforge.spec import spec_from_dict

WORLD = 2


def job(engine: str, args) -> dict:
    base = {
        "name": "bench-engines",
        "model": {"preset": args.preset},
        "parallel": {"dp": WORLD},
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "train": {"global_batch": 8, "micro_batch": 2, "seq_len": args.seq_len, "max_steps": args.steps},
        "data": {"path": "unused"},
    }
    if engine == "deepspeed":
        zero = {"stage": 3}
        if args.offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        base.update(engine="deepspeed", deepspeed={"config": {"zero_optimization": zero}})
    return base


def run_rank(rank: int, port: int, engine_name: str, args, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    spec = spec_from_dict(job(engine_name, args))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dims = build_mesh(device.type, MeshShape.for_spec(spec.parallel))
    engine = create_engine(spec, dims, device)
    vocab = spec.model_arch.vocab_size
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, vocab, (WORLD, spec.grad_accum, spec.train.micro_batch, spec.train.seq_len + 1), generator=gen) for _ in range(args.steps)
    ]
    losses, began = [], None
    for step, batch in enumerate(batches):
        if step == args.warmup:
            dist.barrier()
            began = time.perf_counter()
        losses.append(engine.train_step(batch[rank]).loss)
    dist.barrier()
    seconds = time.perf_counter() - began
    tokens = (args.steps - args.warmup) * spec.train.global_batch * spec.train.seq_len
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peaks = [None] * WORLD
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        out.put({"tokens_per_s": tokens / seconds, "peak_bytes": max(peaks), "losses": losses})
    dist.barrier()
    os._exit(0)  # gloo teardown under load has aborted finished ranks; the work is done


def measure(engine: str, args) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(rank, port, engine, args, out)) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    result = out.get(timeout=1800)
    for proc in procs:
        proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--offload", action="store_true", help="DeepSpeed offloads the optimizer to CPU")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"native": [], "deepspeed": []}
    for _ in range(args.repeats):
        for engine in runs:
            runs[engine].append(measure(engine, args))
    native_losses, ds_losses = runs["native"][0]["losses"], runs["deepspeed"][0]["losses"]
    agree = all(abs(a - b) <= 1e-3 * abs(a) for a, b in zip(native_losses, ds_losses))
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (gloo)"
    print(f"model: {args.preset}, {WORLD} ranks on {device}, {args.steps - args.warmup} timed steps x 8 x {args.seq_len} tokens, fp32")
    print(f"DeepSpeed ZeRO-3{' + optimizer offload' if args.offload else ''} vs native FSDP2 (zero 3)")
    print(f"losses agree within 1e-3: {agree}  (last: native {native_losses[-1]:.5f}, deepspeed {ds_losses[-1]:.5f})")
    summary = {}
    for engine, results in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in results)
        peak = statistics.median(r["peak_bytes"] for r in results)
        summary[engine] = (tps, peak)
        runs_text = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in results)
        print(f"{engine:10s}: {tps:10,.0f} tokens/s  peak {peak / 2**20:8.1f} MiB per rank  (runs: {runs_text})")
    (n_tps, n_peak), (d_tps, d_peak) = summary["native"], summary["deepspeed"]
    print(f"ratio deepspeed / native: tokens/s {d_tps / n_tps:.3f}, peak memory {d_peak / n_peak:.3f}")
    if not agree:
        raise SystemExit("the engines' losses differ: the comparison is not of the same training")


if __name__ == "__main__":
    main()
