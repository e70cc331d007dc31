"""What checking every shard's sha256 as it is read costs the data path.

The feed reads each shard once, as bytes, hashes it and decodes it in the same Ray
Data task (`feed.verified_shards`); the baseline is Ray Data's own Parquet read of
the same shards in the same order, as the feed read them before. Both stream every
shard of one epoch through the same settings (two read tasks, one block per shard,
order kept); the sides alternate, repeated, and the ratio of their medians is printed.

    python bench/shard_reads.py [--files 400] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_DATA_LOG_LEVEL", "WARNING")

import ray

from lmforge.data.corpus import stdlib_files
from lmforge.data.feed import verified_shards
from lmforge.data.prepare import prepare_dataset
from lmforge.data.prepare_options import PrepareOptions

COLUMNS = ["sample_id", "tokens"]


def _context():
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    ctx.use_datasource_v2 = False


def parquet(paths: list[str], _digests) -> int:
    ds = ray.data.read_parquet(paths, num_cpus=0, concurrency=2, columns=COLUMNS, override_num_blocks=len(paths))
    return sum(batch.num_rows for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None, prefetch_batches=2))


def verified(paths: list[str], digests: dict) -> int:
    ds = ray.data.read_binary_files(paths, include_paths=True, num_cpus=0, concurrency=2, override_num_blocks=len(paths))
    ds = ds.map_batches(
        verified_shards,
        fn_kwargs={"digests": digests, "columns": COLUMNS},
        batch_size=None,
        batch_format="pyarrow",
        num_cpus=0,
        compute=ray.data.TaskPoolStrategy(size=2),
    )
    return sum(batch.num_rows for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None, prefetch_batches=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1790, help="stdlib files in the corpus (1790: all)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    _context()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp, "corpus")
        corpus.mkdir()
        for i, path in enumerate(stdlib_files()[: args.files]):
            (corpus / f"{i:05d}.py").write_bytes(Path(path).read_bytes())
        out = Path(tmp, "data")
        manifest = prepare_dataset(PrepareOptions(source=str(corpus), out=str(out), seq_len=128, shard_samples=256, show_progress=False))
        paths = [str(out / s.file) for s in manifest.shards]
        digests = {s.file: s.sha256 for s in manifest.shards}
        size = sum(s.bytes for s in manifest.shards)
        print(f"dataset: {manifest.num_samples:,} samples in {len(paths)} shards, {size / 2**20:.1f} MiB")
        sides = {"parquet (baseline)": parquet, "verified": verified}
        for read in sides.values():  # warm: worker processes, imports
            read(paths, digests)
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(args.repeats):
            for name, read in sides.items():
                began = time.perf_counter()
                rows = read(paths, digests)
                seconds[name].append(time.perf_counter() - began)
                assert rows == manifest.num_samples, (name, rows)
        for name, values in seconds.items():
            print(
                f"{name:20s}: median {statistics.median(values):.3f} s  (runs {min(values):.3f}-{max(values):.3f}), "
                f"{size / 2**20 / statistics.median(values):.0f} MiB/s"
            )
        ratio = statistics.median(seconds["verified"]) / statistics.median(seconds["parquet (baseline)"])
        print(f"verified / baseline: {ratio:.2f}x the time")
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
