"""The offline teacher cache: `lmforge distill cache JOB` runs the job's teachers over
its dataset with Ray Data batch inference (or asks a served teacher,
`distill/served_teacher.py`) and keeps, per token, the top-k next-token ids and
log-probabilities at the distillation temperature.

Its Parquet shards mirror the dataset's row for row (same file names, same sample
ids), for the training split and the held-out one, so the feed reads them beside
the tokens in the same order. The manifest names what the cache was made from, and
training refuses a cache that does not match (`check_cache`). A failed build leaves
nothing: shards are written into a staging directory renamed into place at the end.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from tokenizers import Tokenizer

from lmforge.checkpoint.export import open_source
from lmforge.console import text_column
from lmforge.data import storage
from lmforge.data.corpus import parquet_dataset
from lmforge.data.manifest import EVAL_DIR, DatasetManifest, Shard, read_manifest, tokenizer_location
from lmforge.data.staging import staged
from lmforge.distill.cache_manifest import CachedHeldOut, CacheIdentity, CacheManifest, made_from, write_cache_manifest
from lmforge.distill.cross_tokenizer import AlignedTeacher, aligned_top_k
from lmforge.distill.losses import Mixture, teacher_log_probs
from lmforge.distill.served_teacher import IN_FLIGHT, ROWS_PER_REQUEST, ServedTeacher
from lmforge.distill.teacher import load_whole
from lmforge.preflight import check_cache_build
from lmforge.ray_runtime import tune_process

COLUMNS = ("sample_id", "topk_ids", "topk_logprobs")
# Rows Ray Data hands a scoring actor at once: its cost per batch (a few ms) is paid once
# for them all, while the teachers still forward `rows_per_forward` (the job's
# micro-batch) at a time, so memory and every row's numbers are those of a micro-batch.
ROWS_PER_BATCH = 256


class TeacherTopK:
    """A Ray Data actor: the teachers on this actor's device, turning a batch of samples
    into their top-k targets."""

    def __init__(
        self,
        paths: list[str],
        weights: list[float],
        k: int,
        temperature: float,
        vocab: int,
        threads: int,
        student_tokenizer: Optional[str] = None,
        rows_per_forward: Optional[int] = None,
    ):
        """`student_tokenizer`: the dataset's tokenizer.json text when the teachers read
        its text through their own (`distill.cross_tokenizer`); `rows_per_forward`: rows
        the teachers score at once (all of a batch when None)."""
        tune_process(threads)
        self.rows_per_forward = rows_per_forward
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.teachers = load_whole(paths, self.device)
        self.weights, self.k, self.temperature, self.vocab = weights, k, temperature, vocab
        self.aligned = []
        if student_tokenizer is not None:
            student = Tokenizer.from_str(student_tokenizer)
            teacher_tokenizers = [open_source(path, name="distill.teacher").tokenizer() for path in paths]
            self.aligned = [
                AlignedTeacher(model, student, tokenizer, model.cfg.vocab_size, weight)
                for model, tokenizer, weight in zip(self.teachers, teacher_tokenizers, weights)
            ]

    def __call__(self, batch: dict) -> dict:
        tokens = batch["tokens"]
        tokens = torch.from_numpy((np.stack(tokens) if tokens.dtype == object else tokens).astype(np.int64))
        chunks = tokens.split(self.rows_per_forward or len(tokens))
        ids, values = zip(*(self._top_k(chunk) for chunk in chunks))
        rows = len(tokens)
        return {
            "sample_id": batch["sample_id"],
            "topk_ids": torch.cat(ids).to(torch.int32).reshape(rows, -1).cpu().numpy(),
            "topk_logprobs": torch.cat(values).to(torch.float16).reshape(rows, -1).cpu().numpy(),
        }

    def _top_k(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, log-probabilities) of the teachers' top k after each prefix of these rows."""
        with torch.no_grad():
            inputs = tokens[:, :-1].to(self.device)
            if self.aligned:  # in the student's ids, -1 where the teachers have no target
                targets = aligned_top_k(self.aligned, inputs, self.temperature, self.k, self.vocab)
                values, ids = targets.logprobs, torch.where(targets.aligned[..., None], targets.ids, -1)
            else:
                logits = [teacher(inputs) for teacher in self.teachers]
                teacher = logits[0] if len(logits) == 1 else Mixture(logits, self.weights)
                values, ids = teacher_log_probs(teacher, self.temperature, self.vocab).topk(self.k, dim=-1)
        return ids, values


def actor_pool(cluster: dict, actors: Optional[int] = None) -> dict:
    """A pool of model actors: a GPU per actor when the cluster has GPUs; else two
    single-CPU actors (or one); `actors` of them when given."""
    gpus = int(cluster.get("GPU", 0))
    if gpus:
        return {"concurrency": actors or gpus, "num_gpus": 1, "threads": 4}
    return {"concurrency": actors or max(1, min(2, int(cluster.get("CPU", 1)) // 2)), "num_cpus": 1, "threads": 1}


def _write_split(scored, shards: list[Shard], out: Path, progress, task) -> None:
    """Stream the scored rows, in sample order, into one cache shard per dataset shard
    (the same file name and sample ids)."""
    out.mkdir(parents=True, exist_ok=True)
    held: dict[str, list] = {name: [] for name in COLUMNS}
    count, shard = 0, 0
    for batch in scored.iter_batches(batch_size=None, batch_format="numpy"):
        for name in COLUMNS:
            held[name].append(batch[name])
        count += len(batch["sample_id"])
        while shard < len(shards) and count >= shards[shard].num_samples:
            joined = {name: np.concatenate(held[name]) for name in COLUMNS}
            size = shards[shard].num_samples
            write_shard(out / shards[shard].file, {name: values[:size] for name, values in joined.items()}, shards[shard])
            held = {name: [values[size:]] for name, values in joined.items()}
            count, shard = count - size, shard + 1
            if progress is not None:
                progress.update(task, advance=1)
    if shard != len(shards) or count:
        raise RuntimeError(f"the teacher scored {count} samples past the dataset's shards, or too few: {shard} of {len(shards)} written")


def write_shard(path: Path, rows: dict, shard: Shard) -> None:
    expected = np.arange(shard.first_sample_id, shard.first_sample_id + shard.num_samples)
    if not np.array_equal(rows["sample_id"], expected):
        raise RuntimeError(f"{shard.file}: scored rows arrived out of order")  # Ray Data keeps the order asked for
    table = pa.table(
        {
            "sample_id": pa.array(rows["sample_id"].astype(np.int64)),
            "topk_ids": pa.array(list(rows["topk_ids"]), type=pa.list_(pa.int32())),
            "topk_logprobs": pa.array(list(rows["topk_logprobs"]), type=pa.list_(pa.float16())),
        }
    )
    pq.write_table(table, path, compression="zstd", compression_level=9)


def _splits(data_path: Path, dataset: DatasetManifest, staging: Path) -> list[tuple[str, Path, list[Shard], Path]]:
    """(name, dataset directory, shards, cache directory) of the training and held-out splits."""
    splits = [("train", data_path, dataset.shards, staging)]
    if dataset.eval is not None:
        splits.append(("held-out", data_path / dataset.eval.dir, dataset.eval.shards, staging / EVAL_DIR))
    return splits


def build_cache(spec, show_progress: bool = True) -> CacheManifest:
    """Score the job's dataset with its teachers into `distill.cache`; returns the
    manifest. Requires an initialized Ray session."""
    check_cache_build(spec)
    d = spec.distill
    out, data_path = Path(d.cache), Path(spec.data.path)
    dataset = read_manifest(data_path)
    identity = made_from(spec, dataset)
    began = time.time()
    # The tokenizer's, less any a teacher cannot score (a served teacher's, or other tokenizers': projected onto all of it).
    vocab = min([dataset.tokenizer.vocab_size, *(_teacher_vocab(s.path) for s in d.sources if d.cross_tokenizer is None)])
    scorer_class, scorer, actor, rows = _scorer(spec, dataset, vocab)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # shards are written in sample order
    ctx.enable_progress_bars = False
    with staged(out) as staging:
        splits = _splits(data_path, dataset, staging)
        with _progress(show_progress) as progress:
            for name, directory, shards, target in splits:
                task = progress.add_task(f"teacher top-{d.top_k}, {name}", total=len(shards)) if progress else None
                ds = parquet_dataset([str(directory / s.file) for s in shards], columns=["sample_id", "tokens"])
                scored = ds.map_batches(scorer_class, fn_constructor_kwargs=scorer, batch_size=rows, batch_format="numpy", **actor)
                _write_split(scored, shards, target, progress, task)
        manifest = _manifest(identity, dataset, staging, vocab, time.time() - began)
        write_cache_manifest(staging, manifest)
        return manifest


def _scorer(spec, dataset: DatasetManifest, vocab: int) -> tuple[type, dict, dict, int]:
    """(the Ray Data actor class that scores batches, its arguments, its resources, rows
    per batch): the teachers on this cluster's devices, a micro-batch at a time; or one
    actor asking the served teacher, enough rows at a time to fill its requests in
    flight (its parallelism is the server's, not the cluster's devices)."""
    d = spec.distill
    if d.served is not None:
        served = {"url": d.served.url, "model": d.served.model, "k": d.top_k, "max_retries": d.served.max_retries}
        served["api_key"] = os.environ.get(d.served.api_key_env) if d.served.api_key_env else None
        return ServedTeacher, served, {"compute": ray.data.ActorPoolStrategy(size=1), "num_cpus": 0}, ROWS_PER_REQUEST * IN_FLIGHT
    pool = actor_pool(ray.cluster_resources())
    actor = {
        "compute": ray.data.ActorPoolStrategy(size=pool["concurrency"]),
        "num_gpus": pool.get("num_gpus", 0),
        "num_cpus": pool.get("num_cpus", 0),
    }
    scorer = {
        "paths": [str(s.path) for s in d.sources],
        "weights": [s.weight for s in d.sources],
        "k": d.top_k,
        "temperature": d.temperature,
        "vocab": vocab,
        "threads": pool["threads"],
        "rows_per_forward": spec.train.micro_batch,
    }
    if d.cross_tokenizer is not None:
        scorer["student_tokenizer"] = storage.read_text(tokenizer_location(spec.data.path, dataset), "data.path")
    return TeacherTopK, scorer, actor, ROWS_PER_BATCH


def _teacher_vocab(path: str) -> int:
    return open_source(path, name="distill.teacher").cfg.vocab_size


def _manifest(identity: CacheIdentity, dataset: DatasetManifest, staging: Path, vocab: int, seconds: float) -> CacheManifest:
    size = sum((staging / s.file).stat().st_size for s in dataset.shards)
    return CacheManifest(
        **dict(identity),
        vocab=vocab,
        shards=[s.file for s in dataset.shards],
        bytes=size,
        bytes_per_token=round(size / (dataset.num_samples * dataset.seq_len), 2),
        dense_bf16_bytes_per_token=2 * vocab,
        seconds=round(seconds, 2),
        eval=CachedHeldOut(shards=[s.file for s in dataset.eval.shards]) if dataset.eval else None,
    )


def _progress(enabled: bool):
    if not enabled:
        return nullcontext()  # enters as None: no bar
    return Progress(text_column("{task.description}", bold=True), BarColumn(), MofNCompleteColumn(), text_column("shards"), TimeElapsedColumn())
