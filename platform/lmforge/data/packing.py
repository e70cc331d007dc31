"""Packing tokenized documents into fixed-length samples, and writing them as Parquet
shards with global sample ids (`ShardWriter`); which documents a held-out split takes.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def held_out(index: int, fraction: float) -> bool:
    """Whether document `index` (in source order) belongs to the held-out split: one
    in every 1/fraction, spread evenly through the corpus, the same on every run."""
    return fraction > 0 and math.floor((index + 1) * fraction) > math.floor(index * fraction)


class ShardWriter:
    """Collects packed samples and writes fixed-size Parquet shards with global sample ids."""

    def __init__(self, directory: Path, seq_len: int, shard_samples: int):
        self.directory, self.width, self.shard_samples = directory, seq_len + 1, shard_samples
        self.pending: list[dict[str, np.ndarray]] = []
        self.pending_rows = 0
        self.next_id = 0
        self.shards: list[dict] = []

    def add(self, samples: np.ndarray, **columns: np.ndarray) -> None:
        """`samples`: int32 [rows, seq_len+1]; `columns`: more columns, row for row with
        them, a value or a fixed-width list each (an instruction dataset's loss mask, soft
        targets and where each answer came from)."""
        self.pending.append({"tokens": samples, **columns})
        self.pending_rows += len(samples)
        while self.pending_rows >= self.shard_samples:
            self._flush(self.shard_samples)

    def close(self) -> None:
        if self.pending_rows:
            self._flush(self.pending_rows)

    def _flush(self, rows: int) -> None:
        block = {name: np.concatenate([part[name] for part in self.pending]) for name in self.pending[0]}
        self.pending = [{name: values[rows:] for name, values in block.items()}] if self.pending_rows > rows else []
        self.pending_rows -= rows
        ids = np.arange(self.next_id, self.next_id + rows, dtype=np.int64)
        columns = {name: _column(values[:rows]) for name, values in block.items()}
        name = f"shard-{len(self.shards):05d}.parquet"
        path = self.directory / name
        pq.write_table(pa.table({"sample_id": ids, **columns}), path)
        self.shards.append({
            "file": name,
            "first_sample_id": int(self.next_id),
            "num_samples": rows,
            "bytes": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        })
        self.next_id += rows


def _column(values: np.ndarray) -> pa.Array:
    if values.ndim == 1:
        return pa.array(values)
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])


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
