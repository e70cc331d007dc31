"""Data bytes read per trained token, against the ideal of reading each sample once.

The ideal is the dataset's bytes per sample times the samples trained. The job's
shared reader reads whole shuffle windows, and the run trains whole windows (40
steps of 64 samples, windows of 2 shards of 256), so a layout that reads every
sample once scores 1.0. Before the reader was shared, each rank read every shard of
each window: dp 2 scored 2.0 and dp 2 x tp 2 scored 4.0. Counts, not timings: one
run per layout is exact.

    python bench/data_reads.py [--files 120]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import ray

from lmforge import sdk
from lmforge.data.corpus import stdlib_files
from lmforge.data.prepare import prepare_dataset
from lmforge.data.prepare_options import PrepareOptions
from lmforge.spec import spec_from_dict

LAYOUTS = {"dp 1": {"dp": 1}, "dp 2": {"dp": 2}, "dp 2 x tp 2": {"dp": 2, "tp": 2}}
STEPS, GLOBAL_BATCH, SEQ_LEN = 40, 64, 32


def job(workdir: str, data: str, name: str, parallel: dict) -> dict:
    return {
        "name": name.replace(" ", ""),
        "output_dir": os.path.join(workdir, "runs"),
        "model": {"preset": "tiny", "vocab_size": 512},
        "parallel": parallel,
        "train": {"global_batch": GLOBAL_BATCH, "micro_batch": 8, "seq_len": SEQ_LEN, "max_steps": STEPS, "seed": 1},
        "optim": {"lr": 1e-3, "warmup_steps": 2, "decay_steps": STEPS},
        "data": {"path": data, "shuffle_window": 2, "prefetch_steps": 4},
        "checkpoint": {"interval": STEPS},
        "tracking": {"enabled": False},
        "resources": {"cpus_per_worker": 0.5},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=120, help="the first N files of the built-in corpus")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        corpus = Path(workdir, "corpus")
        corpus.mkdir()
        for i, path in enumerate(stdlib_files()[: args.files]):
            os.symlink(path, corpus / f"{i:05d}.py")
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        data = os.path.join(workdir, "data")
        manifest = prepare_dataset(PrepareOptions(source=str(corpus), out=data, seq_len=SEQ_LEN, vocab_size=512, show_progress=False))
        per_sample = sum(shard.bytes for shard in manifest.shards) / manifest.num_samples
        trained = STEPS * GLOBAL_BATCH
        if trained > manifest.num_samples:
            sys.exit(f"the dataset holds {manifest.num_samples} samples, fewer than the {trained} trained: give more --files")
        ideal = per_sample / SEQ_LEN
        print(
            f"dataset: {manifest.num_samples:,} samples in {len(manifest.shards)} shards, {per_sample:.0f} bytes a sample; "
            f"{STEPS} steps of {GLOBAL_BATCH} samples: ideal {ideal:.2f} bytes per trained token"
        )
        for name, parallel in LAYOUTS.items():
            summary = sdk.train(spec_from_dict(job(workdir, data, name, parallel)), show_progress=False)
            per_token = (summary.data_bytes_read or 0) / summary.tokens
            print(
                f"{name:12s}: {summary.data_bytes_read or 0:>10,} bytes read, {per_token:6.2f} bytes per trained token, "
                f"{per_token / ideal:.3f}x the ideal (target <= 1.2)"
            )
        ray.shutdown()


if __name__ == "__main__":
    main()
