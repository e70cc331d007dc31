"""`lmforge data prepare` throughput against the tokenizer's own speed.

The baseline is `tokenizers`' `encode_batch` over the same texts with the same
tokenizer: the work that cannot be avoided. The lmforge side is `prepare_dataset`
end to end: reading, tokenizing, packing, writing shards and the manifest, Ray
already up. The two run alternately, `--repeats` times each, and the medians are
compared. The driver's own CPU seconds are printed too, and those of the pipeline's
coordinating task on the cluster (Ray Data's executor): work done in either does
not scale out when nodes are added.

    python bench/prepare.py [--repeats 5] [--files 0] [--seq-len 128]
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

import ray

from lmforge.data.corpus import stdlib_files
from lmforge.data.prepare import prepare_dataset
from lmforge.data.prepare_options import PrepareOptions
from lmforge.data.tokenizer import load_tokenizer, train_bpe


def corpus(limit: int) -> tuple[list[str], list[str]]:
    """The built-in corpus's files (the first `limit`, 0: all), and their decodable texts."""
    files = stdlib_files()[: limit or None]
    texts = []
    for path in files:
        try:
            texts.append(Path(path).read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            pass  # as prepare does: skipped and counted
    return files, texts


def encode_batch_seconds(tokenizer_path: str, texts: list[str]) -> tuple[float, int]:
    tokenizer = load_tokenizer(tokenizer_path)
    began = time.perf_counter()
    encodings = tokenizer.encode_batch(texts)
    return time.perf_counter() - began, sum(len(e.ids) for e in encodings)


def prepare_seconds(source: str, tokenizer_path: str, seq_len: int, workdir: str, run: int) -> tuple[float, float, dict]:
    """(wall seconds, the driver's CPU seconds, manifest) of one prepare."""
    opts = PrepareOptions(source=source, out=os.path.join(workdir, f"out-{run}"), seq_len=seq_len, tokenizer=tokenizer_path, show_progress=False)
    cpu, began = time.process_time(), time.perf_counter()
    manifest = prepare_dataset(opts)
    return time.perf_counter() - began, time.process_time() - cpu, manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--files", type=int, default=0, help="the first N files of the built-in corpus (0: all)")
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()

    files, texts = corpus(args.files)
    with tempfile.TemporaryDirectory() as workdir:
        source = os.path.join(workdir, "corpus")
        os.makedirs(source)
        for i, path in enumerate(files):  # a copy, so --files can take a subset as one source folder
            os.symlink(path, os.path.join(source, f"{i:05d}.py"))
        tokenizer_path = os.path.join(workdir, "tokenizer.json")
        train_bpe(texts, 8192).save(tokenizer_path)
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        baseline, lmforge, driver_cpu, coordinator_cpu = [], [], [], []
        tokens = 0
        for run in range(args.repeats):
            seconds, tokens = encode_batch_seconds(tokenizer_path, texts)
            baseline.append(seconds)
            seconds, cpu, manifest = prepare_seconds(source, tokenizer_path, args.seq_len, workdir, run)
            lmforge.append(seconds)
            driver_cpu.append(cpu)
            coordinator_cpu.append(manifest.coordinator_cpu_seconds)
            print(
                f"run {run + 1}: encode_batch {baseline[-1]:.2f} s, prepare {seconds:.2f} s (driver CPU {cpu:.2f} s, "
                f"coordinator CPU {coordinator_cpu[-1]:.2f} s)",
                file=sys.stderr,
            )
        ray.shutdown()
    assert manifest.corpus_tokens == tokens + len(texts) - sum(1 for t in texts if not t), "prepare tokenized other texts"
    base, ours = statistics.median(baseline), statistics.median(lmforge)
    ratios = sorted(b / o for b, o in zip(baseline, lmforge))
    print(f"corpus: {len(files):,} files, {len(texts):,} decodable, {tokens:,} tokens; {os.cpu_count()} CPUs")
    print(f"encode_batch (baseline): {tokens / base:12,.0f} tokens/s  (runs: {', '.join(f'{s:.2f}' for s in baseline)} s)")
    print(f"lmforge data prepare   : {tokens / ours:12,.0f} tokens/s  (runs: {', '.join(f'{s:.2f}' for s in lmforge)} s)")
    print(f"driver CPU: {statistics.median(driver_cpu):.2f} s of {ours:.2f} s wall ({statistics.median(driver_cpu) / ours:.0%}; target < 5%)")
    print(
        f"coordinator task CPU (Ray Data's executor, on the cluster): {statistics.median(coordinator_cpu):.2f} s "
        f"({statistics.median(coordinator_cpu) / ours:.0%} of the wall)"
    )
    print(f"ratio prepare / encode_batch: {base / ours:.3f}  (per-run ratios {ratios[0]:.3f}..{ratios[-1]:.3f}; target >= 0.8)")


if __name__ == "__main__":
    main()
