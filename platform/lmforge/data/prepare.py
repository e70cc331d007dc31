"""`lmforge data prepare`: corpus -> tokenize (Ray Data) -> pack -> Parquet shards + manifest.

Documents are tokenized in parallel by Ray Data in file order, joined with the
end-of-document token and cut into samples of seq_len+1 tokens. Shards are
written into a temporary directory that is renamed into place only when the
manifest is complete, so a failed run leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from tokenizers import Tokenizer

from lmforge.data.corpus import read_documents
from lmforge.data.precheck import check_before_ray
from lmforge.data.tokenizer import eos_id, load_tokenizer, tokenizer_sha256, train_bpe
from lmforge.errors import UserError

MANIFEST = "manifest.json"
_TOKENIZERS: dict[str, Tokenizer] = {}


@dataclass
class PrepareOptions:
    source: str
    out: str
    seq_len: int
    tokenizer: Optional[str] = None
    vocab_size: int = 8192
    text_column: str = "text"
    shard_samples: int = 256
    show_progress: bool = True
    model_vocab_size: Optional[int] = None  # the tokenizer's vocabulary must fit the model's
    names: dict = field(default_factory=dict)  # option -> the flag the user typed, for messages
    skipped: int = field(default=0, init=False)

    @classmethod
    def for_job(cls, spec, **given) -> "PrepareOptions":
        """The job's data section (and `given` values, e.g. from flags)."""
        values = {
            "source": spec.data.source, "out": spec.data.path, "seq_len": spec.train.seq_len, "tokenizer": spec.data.tokenizer,
            "vocab_size": spec.data.vocab_size, "text_column": spec.data.text_column, "shard_samples": spec.data.shard_samples,
            "model_vocab_size": spec.model_arch.vocab_size,
        }
        return cls(**values | {key: value for key, value in given.items() if value is not None})


def _tokenize_batch(batch: dict, tokenizer_json: str) -> dict:
    key = hashlib.sha1(tokenizer_json.encode()).hexdigest()
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = Tokenizer.from_str(tokenizer_json)
    encodings = _TOKENIZERS[key].encode_batch([str(t) for t in batch["text"]])
    return {"ids": [np.asarray(e.ids, dtype=np.int32) for e in encodings], "bad": batch["bad"]}


class ShardWriter:
    """Collects packed samples and writes fixed-size Parquet shards with global sample ids."""

    def __init__(self, directory: Path, seq_len: int, shard_samples: int):
        self.directory, self.width, self.shard_samples = directory, seq_len + 1, shard_samples
        self.pending: list[np.ndarray] = []
        self.pending_rows = 0
        self.next_id = 0
        self.shards: list[dict] = []

    def add(self, samples: np.ndarray) -> None:
        self.pending.append(samples)
        self.pending_rows += len(samples)
        while self.pending_rows >= self.shard_samples:
            self._flush(self.shard_samples)

    def close(self) -> None:
        if self.pending_rows:
            self._flush(self.pending_rows)

    def _flush(self, rows: int) -> None:
        block = np.concatenate(self.pending)
        chunk, rest = block[:rows], block[rows:]
        self.pending, self.pending_rows = ([rest] if len(rest) else []), len(rest)
        ids = np.arange(self.next_id, self.next_id + rows, dtype=np.int64)
        tokens = pa.FixedSizeListArray.from_arrays(pa.array(chunk.reshape(-1), pa.int32()), self.width)
        name = f"shard-{len(self.shards):05d}.parquet"
        path = self.directory / name
        pq.write_table(pa.table({"sample_id": ids, "tokens": tokens}), path)
        self.shards.append({
            "file": name,
            "first_sample_id": int(self.next_id),
            "num_samples": rows,
            "bytes": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        })
        self.next_id += rows


class Packer:
    """Joins documents with EOS in order and cuts the stream into samples of `width` tokens.

    The tail shorter than one sample is carried to the next call and dropped at the end.
    """

    def __init__(self, eos: int, width: int):
        self.eos = np.asarray([eos], dtype=np.int32)
        self.width = width
        self.carry = np.zeros(0, dtype=np.int32)
        self.tokens = 0

    def add(self, documents: list[np.ndarray]) -> np.ndarray:
        parts = [self.carry]
        for ids in documents:
            if len(ids):
                parts += [np.asarray(ids, dtype=np.int32), self.eos]
        stream = np.concatenate(parts)
        self.tokens += len(stream) - len(self.carry)
        full = len(stream) // self.width
        self.carry = stream[full * self.width :]
        return stream[: full * self.width].reshape(full, self.width)


def _pack(ds: ray.data.Dataset, eos: int, writer: ShardWriter, opts: PrepareOptions, progress, task) -> int:
    """Streams tokenized documents in order into shards; returns the corpus token count."""
    packer = Packer(eos, writer.width)
    for batch in ds.iter_batches(batch_size=64, batch_format="numpy"):
        docs = [ids for ids, bad in zip(batch["ids"], batch["bad"]) if not bad]
        opts.skipped += len(batch["bad"]) - len(docs)
        samples = packer.add(docs)
        if len(samples):
            writer.add(samples)
        if progress is not None:
            progress.update(task, advance=len(batch["bad"]))
    return packer.tokens


def _get_tokenizer(ds: ray.data.Dataset, opts: PrepareOptions) -> Tokenizer:
    if opts.tokenizer:
        return load_tokenizer(opts.tokenizer)
    texts = (str(t) for b in ds.iter_batches(batch_size=256, batch_format="numpy") for t, bad in zip(b["text"], b["bad"]) if not bad)
    return train_bpe(texts, opts.vocab_size)


def prepare_dataset(opts: PrepareOptions) -> dict:
    """Run the pipeline; returns the manifest. Requires an initialized Ray session."""
    files = check_before_ray(opts)
    out = Path(opts.out)
    if (out / MANIFEST).exists():
        raise UserError(f"{out}: already holds a prepared dataset; remove it or choose another --out")
    started = time.time()
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    docs = read_documents(files, opts.text_column)
    tokenizer = _get_tokenizer(docs, opts)
    eos = eos_id(tokenizer)
    tokenized = docs.map_batches(_tokenize_batch, fn_kwargs={"tokenizer_json": tokenizer.to_str()}, batch_size=32, batch_format="numpy", num_cpus=0.5)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        writer = ShardWriter(staging, opts.seq_len, opts.shard_samples)
        with _progress(opts.show_progress) as progress:
            task = progress.add_task("tokenizing", total=len(files) if len(files) > 1 else None) if progress else None
            tokens = _pack(tokenized, eos, writer, opts, progress, task)
        writer.close()
        if writer.next_id == 0:
            raise UserError(
                f"data.source: {opts.source} yields {tokens} tokens, fewer than one sample of "
                f"seq_len+1 = {opts.seq_len + 1}; the corpus is empty or too small"
            )
        tokenizer.save(str(staging / "tokenizer.json"))
        manifest = {
            "format": "lmforge.packed.v1",
            "source": opts.source,
            "seq_len": opts.seq_len,
            "num_samples": writer.next_id,
            "num_tokens": writer.next_id * (opts.seq_len + 1),
            "shard_samples": opts.shard_samples,
            "corpus_tokens": tokens,
            "documents": len(files),
            "skipped_documents": opts.skipped,
            "tokenizer": {
                "file": "tokenizer.json",
                "sha256": tokenizer_sha256(tokenizer),
                "vocab_size": tokenizer.get_vocab_size(),
                "eos_id": eos,
            },
            "shards": writer.shards,
            "seconds": round(time.time() - started, 2),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if out.exists():
            out.rmdir()  # only an empty directory may be replaced
        staging.rename(out)
        return manifest
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


class _NoProgress:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _progress(enabled: bool):
    if not enabled:
        return _NoProgress()
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("documents"), TimeElapsedColumn())


def read_manifest(path: str | Path) -> dict:
    """Load and sanity-check a prepared dataset's manifest; `UserError` names the file."""
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        raise UserError(f"data.path: {path} holds no prepared dataset ({MANIFEST} missing); set data.source to prepare one")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"{manifest_path}: unreadable manifest ({err})") from None
    if manifest.get("format") != "lmforge.packed.v1" or not manifest.get("shards"):
        raise UserError(f"{manifest_path}: not an lmforge dataset manifest")
    size = manifest["shard_samples"]
    for index, shard in enumerate(manifest["shards"]):
        if not (Path(path) / shard["file"]).is_file():
            raise UserError(f"{manifest_path}: shard {shard['file']} is missing")
        # The feed shuffles whole shards, so every shard but the last is full.
        if shard["first_sample_id"] != index * size or (shard["num_samples"] != size and index < len(manifest["shards"]) - 1):
            raise UserError(f"{manifest_path}: shard {shard['file']} does not hold samples {index * size}..{(index + 1) * size - 1}")
    return manifest
