"""The deterministic, resumable feed of global batches.

One global order of sample ids (a seeded permutation per epoch) defines every
optimizer step's global batch; a DP rank takes its contiguous slice of it and
splits that into micro-batches. The order depends on neither dp nor restarts, so
the cursor (samples consumed = step x global batch) is all a checkpoint needs.
Ray Data reads each rank's samples from the Parquet shards in a background
thread, `prefetch_steps` optimizer steps ahead of the trainer.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
from ray.data.expressions import col

_EPOCH_STRIDE = 1_000_003  # keeps (seed, epoch) streams apart for any seed


class GlobalOrder:
    """Maps global sample positions (0, 1, 2, ... over all epochs) to sample ids."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples, self.seed = num_samples, seed
        self._cache: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) > 2:
                self._cache.clear()
            rng = np.random.default_rng(self.seed * _EPOCH_STRIDE + epoch)
            self._cache[epoch] = rng.permutation(self.num_samples)
        return self._cache[epoch]

    def ids(self, start: int, count: int) -> np.ndarray:
        positions = np.arange(start, start + count)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(positions // self.num_samples):
            mask = positions // self.num_samples == epoch
            out[mask] = self.permutation(int(epoch))[positions[mask] % self.num_samples]
        return out


@dataclass(frozen=True)
class BatchLayout:
    global_batch: int
    micro_batch: int
    dp: int

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.dp

    @property
    def accum(self) -> int:
        return self.per_rank // self.micro_batch

    def rank_positions(self, step: int, dp_rank: int) -> tuple[int, int]:
        """(first global position, count) of this rank's share of step `step`."""
        return step * self.global_batch + dp_rank * self.per_rank, self.per_rank


class ShardReader:
    """Reads samples by id from the dataset's Parquet shards with Ray Data."""

    def __init__(self, data_path: str, manifest: dict):
        self.paths = [str(Path(data_path) / s["file"]) for s in manifest["shards"]]
        self.starts = np.asarray([s["first_sample_id"] for s in manifest["shards"]])
        self.width = manifest["seq_len"] + 1

    def read(self, ids: np.ndarray) -> np.ndarray:
        wanted = np.unique(ids)
        shard_idx = np.unique(np.searchsorted(self.starts, wanted, side="right") - 1)
        ds = ray.data.read_parquet([self.paths[i] for i in shard_idx], num_cpus=0.1)
        ds = ds.filter(expr=col("sample_id").is_in(wanted.tolist()))
        found: dict[int, np.ndarray] = {}
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            sample_ids = batch.column("sample_id").to_numpy()
            tokens = batch.column("tokens").combine_chunks().flatten().to_numpy().reshape(-1, self.width)
            found.update(zip(sample_ids.tolist(), tokens))
        missing = set(wanted.tolist()) - found.keys()
        if missing:
            raise RuntimeError(f"samples missing from the shards: {sorted(missing)[:5]}")
        return np.stack([found[int(i)] for i in ids])


class BatchFeed:
    """Yields this rank's micro-batches step by step, read ahead in a background thread."""

    def __init__(self, reader: ShardReader, order: GlobalOrder, layout: BatchLayout, dp_rank: int, start_step: int, prefetch_steps: int):
        self.reader, self.order, self.layout, self.dp_rank = reader, order, layout, dp_rank
        self.prefetch_steps = prefetch_steps
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._next_step = start_step
        self._buffer: list[tuple[int, np.ndarray, np.ndarray]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(start_step,), name="lmforge-feed", daemon=True)
        self._thread.start()

    def step_ids(self, step: int) -> np.ndarray:
        start, count = self.layout.rank_positions(step, self.dp_rank)
        return self.order.ids(start, count)

    def _produce(self, step: int) -> None:
        try:
            while not self._stop.is_set():
                steps = range(step, step + self.prefetch_steps)
                ids = np.concatenate([self.step_ids(s) for s in steps])
                tokens = self.reader.read(ids)
                per = self.layout.per_rank
                chunk = [(s, ids[i * per : (i + 1) * per], tokens[i * per : (i + 1) * per]) for i, s in enumerate(steps)]
                while not self._stop.is_set():
                    try:
                        self._queue.put(chunk, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                step += self.prefetch_steps
        except BaseException as err:  # surfaced to the trainer on its next call
            self._queue.put(err)

    def next(self) -> tuple[int, np.ndarray, np.ndarray, float]:
        """Returns (step, sample ids, tokens [accum, micro, seq_len+1], seconds waited)."""
        waited = 0.0
        if not self._buffer:
            began = time.perf_counter()
            item = self._queue.get()
            waited = time.perf_counter() - began
            if isinstance(item, BaseException):
                raise item
            self._buffer = list(item)
        step, ids, tokens = self._buffer.pop(0)
        assert step == self._next_step, f"feed out of order: got step {step}, expected {self._next_step}"
        self._next_step += 1
        shape = (self.layout.accum, self.layout.micro_batch, tokens.shape[-1])
        return step, ids, tokens.reshape(shape), waited

    def close(self) -> None:
        self._stop.set()
