"""Writing samples as Parquet shards with global sample ids (`write_shard`, and
`ShardWriter` for samples that come in a stream); which documents a held-out split
takes. Packing a corpus's documents into samples is `data.streams`.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lmforge.data import storage


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
        path = self.directory / f"shard-{len(self.shards):05d}.parquet"
        self.shards.append(write_shard(str(path), self.next_id, {name: values[:rows] for name, values in block.items()}))
        self.next_id += rows


def write_shard(path: str, first_sample_id: int, columns: dict[str, np.ndarray]) -> dict:
    """One Parquet shard of consecutive samples (a column of values or fixed-width rows
    each) at a path or URI, and its manifest entry: file, first id, count, bytes, sha256."""
    rows = len(next(iter(columns.values())))
    ids = np.arange(first_sample_id, first_sample_id + rows, dtype=np.int64)
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.table({"sample_id": ids, **{name: _column(values) for name, values in columns.items()}}), buffer)
    data = buffer.getvalue().to_pybytes()
    storage.write_bytes(path, data)
    return {
        "file": path.rsplit("/", 1)[-1],
        "first_sample_id": int(first_sample_id),
        "num_samples": rows,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def _column(values: np.ndarray) -> pa.Array:
    if values.ndim == 1:
        return pa.array(values)
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])
