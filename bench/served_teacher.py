"""A teacher behind a server against the same teacher in-process: the step time of a
distillation job trained straight from `lmforge serve` (its top-k asked by the feed
reader, a chunk ahead of the ranks) over the same job with the model as an online
top-k teacher, target <= 1.2; and the bytes on the wire per token of the targets.

A local Ray cluster; the data is 40 of the standard library's files in a BPE of 4,096
tokens, rows of 128; the teacher is the `small` preset (seeded, that tokenizer),
served by one replica on Ray Serve; the student `tiny`, one rank, 8 rows a step, top
20 at temperature 1. Each repeat runs both jobs, one after the other, and compares
their median step time (steps 4 on: start-up excluded); repeats go on until the
ratios' spread is smaller than their distance from the target.

    python bench/served_teacher.py [--steps 30] [--min-repeats 3] [--max-repeats 6]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import urllib.request
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pyarrow.parquet as pq
import ray
from ray import serve

from distill import settled, verdict
from lmforge import sdk
from lmforge.data.corpus import stdlib_files
from lmforge.data.manifest import read_manifest
from lmforge.data.prepare import prepare_dataset
from lmforge.data.prepare_options import PrepareOptions
from lmforge.distill.served_teacher import ServedTeacher
from lmforge.models import PRESETS
from lmforge.models.build import build_model
from lmforge.models.weights import write_model_dir
from lmforge.serve.app import application
from lmforge.serve.options import ServerOptions
from lmforge.spec import spec_from_dict

VOCAB, SEQ, K = 4096, 128, 20
TARGET = 1.2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dataset(tmp: Path) -> Path:
    corpus = tmp / "corpus"
    corpus.mkdir()
    for i, path in enumerate([f for f in stdlib_files() if "/test" not in f][::40][:40]):
        shutil.copy(path, corpus / f"{i:03d}_{Path(path).name}")
    prepare_dataset(PrepareOptions(source=str(corpus), out=str(tmp / "data"), seq_len=SEQ, vocab_size=VOCAB, show_progress=False))
    return tmp / "data"


def job(tmp: Path, data: Path, name: str, teacher, steps: int) -> dict:
    return {
        "name": name,
        "output_dir": str(tmp / "runs"),
        "model": {"preset": "tiny", "vocab_size": VOCAB},
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "train": {"global_batch": 8, "micro_batch": 4, "seq_len": SEQ, "max_steps": steps, "seed": 1},
        "data": {"path": str(data), "prefetch_steps": 4},
        "checkpoint": {"interval": 10_000, "resume": False},
        "tracking": {"experiment": "bench", "uri": f"sqlite:///{tmp}/mlflow.db", "system_metrics_s": 0},
        "distill": {"teacher": teacher, "top_k": K},
    }


def median_step(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(row["step_time"] for row in rows if "event" not in row and row["step"] >= 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--min-repeats", type=int, default=3)
    parser.add_argument("--max-repeats", type=int, default=6)
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        data = dataset(tmp)
        teacher = tmp / "teacher"
        cfg = PRESETS["small"].with_overrides(vocab_size=VOCAB)
        tokenizer = (data / read_manifest(data).tokenizer.file).read_text()
        write_model_dir(teacher, "lmforge", cfg, build_model(cfg, seed=7).state_dict(), files={"tokenizer.json": tokenizer})
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = ServerOptions(model=str(teacher), name="teacher", max_running=16)
        serve.run(application(options, 1, 1, 0.0), name="teacher", route_prefix="/teacher", blocking=False)  # returns once it is ready
        url = f"http://127.0.0.1:{port}/teacher/v1"
        assert urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30).status == 200
        rows = pq.read_table(data / read_manifest(data).shards[0].file, columns=["tokens"]).slice(0, 64).column("tokens").to_pylist()
        wire = ServedTeacher(url, "teacher", K)
        wire.score(np.array(rows))
        sides = {"in-process teacher": str(teacher), "served teacher": {"url": url, "model": "teacher", "top_k": K}}
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        ratios: list[float] = []
        while len(ratios) < args.max_repeats:
            for name, source in sides.items():
                spec = spec_from_dict(job(tmp, data, f"{name.split()[0]}-{len(ratios)}", source, args.steps))
                seconds[name].append(median_step(Path(sdk.train(spec, show_progress=False).run_dir)))
            ratios.append(seconds["served teacher"][-1] / seconds["in-process teacher"][-1])
            if len(ratios) >= args.min_repeats and settled(ratios, TARGET):
                break
        serve.shutdown()
    print(
        f"student: tiny, teacher: small ({cfg.num_params():,} params) served by one replica; vocab {VOCAB}, top {K}, 8 x {SEQ} tokens a step, 1 rank"
    )
    print(f"{len(ratios)} repeats of {args.steps} steps per side (median step from step 4)")
    for name, times in seconds.items():
        print(f"  {name:20s} {statistics.median(times) * 1000:8.1f} ms/step")
    print(f"  served / in-process: {verdict(ratios, TARGET)}")
    print(f"  on the wire: {wire.bytes_received / wire.tokens_scored:,.0f} bytes of response per token at k = {K} (JSON)")
    ray.shutdown()


if __name__ == "__main__":
    main()
