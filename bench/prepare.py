"""`lmforge data prepare` throughput against the tokenizer's own speed.

The baseline is `tokenizers`' `encode_batch` over the same texts with the same
tokenizer: the work that cannot be avoided. The lmforge side is `prepare_dataset`
end to end: reading, tokenizing, packing, writing shards and the manifest, Ray
already up. The two run alternately, `--repeats` times each, and the medians are
compared. The driver's own CPU seconds are printed too, and those of the pipeline's
coordinating task on the cluster (Ray Data's executor): work done in either does
not scale out when nodes are added.

    python bench/prepare.py [--repeats 5] [--files 0] [--seq-len 128]

`--cli` measures it as a user runs it instead: `lmforge data prepare` as a whole
process (its own embedded Ray, the CLI, progress on) over half the corpus and over
all of it, interleaved with `encode_batch` over the half that the larger run adds.
Two sizes separate the fixed cost (start-up: Ray, the CLI, the first tasks) from the
rate: the marginal rate is the added tokens over the added seconds, against
`encode_batch`'s on the same added texts (target >= 0.8x), and the fixed cost is what
the smaller run took beyond its tokens at that rate (target <= 5 s).

    python bench/prepare.py --cli [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import ray

from lmforge.data.corpus import stdlib_files
from lmforge.data.manifest import read_manifest
from lmforge.data.prepare import prepare_dataset
from lmforge.data.prepare_options import PrepareOptions
from lmforge.data.tokenizer import load_tokenizer, train_bpe


def corpus(limit: int) -> tuple[list[str], list[str]]:
    """The built-in corpus's files (the first `limit`, 0: all), and their decodable texts."""
    files = stdlib_files()[: limit or None]
    return files, [t for t in map(decoded, files) if t is not None]  # undecodable: skipped and counted, as prepare does


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


def linked(files: list[str], folder: str) -> str:
    """A folder of links to `files`: one source, as prepare reads it."""
    os.makedirs(folder)
    for i, path in enumerate(files):
        os.symlink(path, os.path.join(folder, f"{i:05d}.py"))
    return folder


def cli_seconds(source: str, tokenizer_path: str, seq_len: int, out: str) -> tuple[float, int]:
    """(wall seconds, corpus tokens) of `lmforge data prepare` as its own process."""
    cmd = [sys.executable, "-m", "lmforge", "data", "prepare", "--source", source, "--out", out, "--seq-len", str(seq_len)]
    began = time.perf_counter()
    done = subprocess.run([*cmd, "--tokenizer", tokenizer_path], capture_output=True, text=True)
    seconds = time.perf_counter() - began
    assert done.returncode == 0, done.stderr[-2000:]
    return seconds, read_manifest(out, check_shards=False).corpus_tokens


def cli_main(args, files: list[str], texts: list[str]) -> None:
    """Half the corpus and all of it through the CLI, interleaved with `encode_batch` over the added half."""
    half = len(files) // 2
    added = [t for t in (decoded(path) for path in files[half:]) if t is not None]
    with tempfile.TemporaryDirectory() as workdir:
        sources = {"half": linked(files[:half], os.path.join(workdir, "half")), "all": linked(files, os.path.join(workdir, "all"))}
        tokenizer_path = os.path.join(workdir, "tokenizer.json")
        train_bpe(texts, 8192).save(tokenizer_path)
        seconds: dict[str, list[float]] = {"half": [], "all": [], "encode_added": []}
        tokens: dict[str, int] = {}
        for run in range(args.repeats):
            for size in ("half", "all"):
                took, tokens[size] = cli_seconds(sources[size], tokenizer_path, args.seq_len, os.path.join(workdir, f"{size}-{run}"))
                seconds[size].append(took)
            took, tokens["encode_added"] = encode_batch_seconds(tokenizer_path, added)
            seconds["encode_added"].append(took)
            print(f"run {run + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in seconds.items()), file=sys.stderr)
    median = {k: statistics.median(v) for k, v in seconds.items()}
    added_tokens = tokens["all"] - tokens["half"]
    marginal = added_tokens / (median["all"] - median["half"])
    baseline = tokens["encode_added"] / median["encode_added"]
    fixed = median["half"] - tokens["half"] / marginal
    per_run = sorted(
        (added_tokens / (a - h)) / (tokens["encode_added"] / e) for h, a, e in zip(seconds["half"], seconds["all"], seconds["encode_added"])
    )
    print(f"corpus: {len(files):,} files; half {tokens['half']:,} tokens, all {tokens['all']:,}; {os.cpu_count()} CPUs")
    print(f"lmforge data prepare (CLI): half {median['half']:.2f} s, all {median['all']:.2f} s (medians of {args.repeats})")
    print(f"marginal rate: {marginal:,.0f} tokens/s; encode_batch on the added texts: {baseline:,.0f} tokens/s")
    print(f"ratio marginal / encode_batch: {marginal / baseline:.3f}  (per-run {per_run[0]:.3f}..{per_run[-1]:.3f}; target >= 0.8)")
    print(f"fixed cost: {fixed:.1f} s  (target <= 5 s)")


def decoded(path: str) -> str | None:
    try:
        return Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--files", type=int, default=0, help="the first N files of the built-in corpus (0: all)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--cli", action="store_true", help="the CLI as a whole process, at two corpus sizes (fixed cost and marginal rate)")
    args = parser.parse_args()

    files, texts = corpus(args.files)
    if args.cli:
        cli_main(args, files, texts)
        return
    with tempfile.TemporaryDirectory() as workdir:
        source = linked(files, os.path.join(workdir, "corpus"))  # so --files can take a subset as one source folder
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
