"""Cross-tokenizer distillation's cost: an online KD step whose teacher reads the
student's text through its own tokenizer (`distill.cross_tokenizer`: decode, encode,
align, project onto the student's vocabulary) against the same step with a teacher of
the student's tokenizer; prints cross / same, target <= 1.3.

Two byte-level BPEs trained here on the same source files (the student's 4,000 tokens,
the teacher's 6,000), real text in the student's tokens, one rank (a gloo group of
one), the native engine. The teacher is the `small` preset with 6,144 embedding rows
on both sides (the same weights): only the tokenizer differs. Both learn the top 32 at
temperature 2. Sides take turns batch by batch, timed in this process's CPU time, and
repeats go on until the spread is smaller than the distance from the target.

    python bench/cross_tokenizer.py [--steps 10] [--k 32]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist

from distill import settled, timed, verdict
from lmforge.data.corpus import stdlib_files
from lmforge.data.tokenizer import train_bpe
from lmforge.engines import create_engine
from lmforge.models import PRESETS
from lmforge.models.build import build_model
from lmforge.models.weights import write_model_dir
from lmforge.parallel.mesh import build_mesh
from lmforge.parallel.shape import MeshShape
from lmforge.ray_runtime import tune_process
from lmforge.spec import spec_from_dict
from lmforge.trainer import job_loss

STUDENT_TOKENS, TEACHER_TOKENS, TEACHER_ROWS = 4000, 6000, 6144
SEQ, MICRO, ACCUM = 128, 4, 2
TARGET = 1.3


def job(teacher_dir: str, k: int, cross: bool) -> dict:
    distill = {"teacher": teacher_dir, "temperature": 2.0, "top_k": k}
    return {
        "name": "bench-cross-tokenizer",
        "model": {"preset": "tiny", "vocab_size": 4096},
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "train": {"global_batch": MICRO * ACCUM, "micro_batch": MICRO, "seq_len": SEQ, "max_steps": 10_000},
        "data": {"path": "unused"},
        "distill": distill | ({"cross_tokenizer": {"method": "projection"}} if cross else {}),
    }


def text_batches(tokenizer, texts: list[str], count: int) -> list[torch.Tensor]:
    """Rows of real text in the student's tokens, as a packed dataset cuts them."""
    ids = [token for text in texts for token in tokenizer.encode(text).ids]
    rows = torch.tensor(ids[: len(ids) // (SEQ + 1) * (SEQ + 1)]).view(-1, SEQ + 1)
    per_step = ACCUM * MICRO
    return [rows[i * per_step : (i + 1) * per_step].view(ACCUM, MICRO, SEQ + 1) for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per side per repeat")
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--min-repeats", type=int, default=4)
    parser.add_argument("--max-repeats", type=int, default=10)
    args = parser.parse_args()
    tune_process(int(os.environ["OMP_NUM_THREADS"]))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    device = torch.device("cpu")
    texts = [Path(f).read_text(errors="replace") for f in stdlib_files()[:40]]
    student_tokenizer, teacher_tokenizer = train_bpe(texts, STUDENT_TOKENS), train_bpe(texts, TEACHER_TOKENS)
    with tempfile.TemporaryDirectory() as tmp:
        teacher_cfg = PRESETS["small"].with_overrides(vocab_size=TEACHER_ROWS)
        weights = build_model(teacher_cfg, seed=7).state_dict()
        student_file = f"{tmp}/student-tokenizer.json"
        student_tokenizer.save(student_file)
        engines = {}
        for name, tokenizer, cross in (("same tokenizer", student_tokenizer, False), ("cross tokenizer", teacher_tokenizer, True)):
            teacher_dir = f"{tmp}/{name.replace(' ', '-')}"
            write_model_dir(teacher_dir, "lmforge", teacher_cfg, weights)
            tokenizer.save(f"{teacher_dir}/tokenizer.json")
            spec = spec_from_dict(job(teacher_dir, args.k, cross))
            dims = build_mesh(device.type, MeshShape.for_spec(spec.parallel))
            engines[name] = create_engine(spec, dims, device, job_loss(spec, student_tokenizer.get_vocab_size(), 0, student_file))
        shutil.rmtree(tmp, ignore_errors=True)
    data = text_batches(student_tokenizer, texts, args.steps)
    aligned = engines["cross tokenizer"].loss.aligned[0]
    share = sum(aligned.rows(micro[:, :-1]).aligned.float().mean().item() for batch in data for micro in batch) / (len(data) * ACCUM)
    sides = {f"KD step, {name}": engine.train_step for name, engine in engines.items()}
    timed(sides, data[:2])  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    ratios: list[float] = []
    while len(ratios) < args.max_repeats:
        for name, spent in timed(sides, data).items():
            seconds[name].append(spent)
        ratios.append(seconds["KD step, cross tokenizer"][-1] / seconds["KD step, same tokenizer"][-1])
        if len(ratios) >= args.min_repeats and settled(ratios, TARGET):
            break
    tokens = MICRO * ACCUM * SEQ
    print(
        f"student: tiny, its BPE of {STUDENT_TOKENS} tokens; teacher: small ({teacher_cfg.num_params():,} params), "
        f"its BPE of {TEACHER_TOKENS}; top {args.k}; {tokens} tokens per step, 1 rank, {torch.get_num_threads()} threads; "
        f"{share:.0%} of the student's positions aligned"
    )
    print(f"{len(ratios)} repeats of {args.steps} steps per side, sides interleaved")
    for name, times in seconds.items():
        print(f"  {name:28s} {statistics.median(times) * 1000:8.1f} ms/step")
    print(f"  cross / same tokenizer: {verdict(ratios, TARGET)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
