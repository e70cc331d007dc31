"""Streaming each rank's batches from the Parquet shards with Ray Data.

A `FeedReader` actor per rank runs one Ray Data stream per epoch over the shards
in the epoch's block order (see `order.GlobalOrder`), keeps a window of samples,
and hands out whole chunks of steps. The trainer (`BatchFeed`) keeps the next
chunk requested, so it only waits on an object reference: reading never
competes with the training loop for its interpreter.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import ray

from lmforge.data.order import BatchLayout, GlobalOrder


class EpochStream:
    """Samples of one epoch from `first_window` on, as Ray Data reads them, by window."""

    def __init__(self, paths: list[str], order: GlobalOrder, width: int, epoch: int, first_window: int):
        self.order, self.width, self.epoch = order, width, epoch
        blocks = order.blocks(epoch)[first_window * order.window :]
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True  # bounds what is held: files arrive in block order
        ctx.enable_progress_bars = False
        # The V2 Parquet path (Ray 2.60) delivers nothing until every file is read and
        # takes ~50 ms a file here; V1 streams the same shards 10x faster.
        ctx.use_datasource_v2 = False
        # Two read tasks per rank keep the stream ahead without starting dozens of
        # worker processes on a small machine. They reserve no CPU: when the ranks
        # hold every CPU of the cluster, reading must still go on, or training waits forever.
        # They run beside this reader where they can, so blocks need not cross nodes.
        here = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        ds = ray.data.read_parquet([paths[b] for b in blocks], num_cpus=0, concurrency=2, columns=["sample_id", "tokens"],
                                   ray_remote_args={"scheduling_strategy": here})
        self._batches: Iterator = iter(ds.iter_batches(batch_format="pyarrow", batch_size=None, prefetch_batches=2))
        self.samples: dict[int, np.ndarray] = {}

    def take_window(self, index: int) -> dict[int, np.ndarray]:
        """Rows of window `index`, reading on until all of them have arrived."""
        wanted = self.order.window_ids(self.epoch, index).tolist()
        missing = set(wanted) - self.samples.keys()
        while missing:
            batch = next(self._batches, None)
            if batch is None:
                raise RuntimeError(f"shards ended before samples {sorted(missing)[:5]} of epoch {self.epoch} arrived")
            ids = batch.column("sample_id").to_numpy().tolist()
            tokens = batch.column("tokens").combine_chunks().flatten().to_numpy().reshape(-1, self.width)
            self.samples.update(zip(ids, tokens))
            missing.difference_update(ids)
        return {i: self.samples[i] for i in wanted}

    def drop(self, ids) -> None:
        for i in ids:
            self.samples.pop(int(i), None)


@ray.remote(num_cpus=0)
class FeedReader:
    def __init__(self, data_path: str, manifest: dict, order: GlobalOrder, layout: BatchLayout, dp_rank: int):
        self.paths = [str(Path(data_path) / s["file"]) for s in manifest["shards"]]
        self.width = manifest["seq_len"] + 1
        self.order, self.layout, self.dp_rank = order, layout, dp_rank
        self.stream: Optional[EpochStream] = None
        self.current: tuple[int, int] = (-1, -1)
        self.rows: dict[int, np.ndarray] = {}

    def _rows_for(self, position: int) -> dict[int, np.ndarray]:
        epoch, window = self.order.locate(position)
        if (epoch, window) != self.current:
            if self.stream is None or self.stream.epoch != epoch or window < self.current[1]:
                self.stream = EpochStream(self.paths, self.order, self.width, epoch, window)
            self.stream.drop(self.rows)
            self.rows = self.stream.take_window(window)
            self.current = (epoch, window)
        return self.rows

    def chunk(self, first_step: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, tokens) of this rank for `steps` steps, step-major."""
        ids, tokens = [], []
        for step in range(first_step, first_step + steps):
            start, count = self.layout.rank_positions(step, self.dp_rank)
            step_ids = self.order.ids(start, count)
            for position, sample in zip(range(start, start + count), step_ids):
                tokens.append(self._rows_for(position)[int(sample)])
            ids.append(step_ids)
        return np.concatenate(ids), np.stack(tokens)


class BatchFeed:
    """The trainer's side: yields (step, ids, micro-batches, seconds waited)."""

    def __init__(self, data_path: str, manifest: dict, order: GlobalOrder, layout: BatchLayout, dp_rank: int, start_step: int, prefetch_steps: int):
        # On this rank's node, strictly: a soft affinity lets Ray move a reader to a node
        # it still counts as free, such as one that vanished moments ago and is not yet
        # declared dead (seen after a node loss: the restarted rank failed again).
        node = ray.get_runtime_context().get_node_id()
        affinity = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node, soft=False)
        self.reader = FeedReader.options(scheduling_strategy=affinity).remote(data_path, manifest, order, layout, dp_rank)
        self.layout, self.prefetch_steps = layout, prefetch_steps
        self._next_step = self._next_request = start_step
        self._in_flight: deque = deque()
        self._buffer: deque = deque()
        for _ in range(2):
            self._request()

    def _request(self) -> None:
        self._in_flight.append((self._next_request, self.reader.chunk.remote(self._next_request, self.prefetch_steps)))
        self._next_request += self.prefetch_steps

    def _receive(self) -> float:
        first, ref = self._in_flight.popleft()
        began = time.perf_counter()
        ids, tokens = ray.get(ref)
        waited = time.perf_counter() - began
        self._request()
        per = self.layout.per_rank
        for i in range(self.prefetch_steps):
            self._buffer.append((first + i, ids[i * per : (i + 1) * per], tokens[i * per : (i + 1) * per]))
        return waited

    def next(self) -> tuple[int, np.ndarray, np.ndarray, float]:
        """Returns (step, sample ids, tokens [accum, micro, seq_len+1], seconds waited)."""
        waited = self._receive() if not self._buffer else 0.0
        step, ids, tokens = self._buffer.popleft()
        assert step == self._next_step, f"feed out of order: got step {step}, expected {self._next_step}"
        self._next_step += 1
        return step, ids, tokens.reshape(self.layout.accum, self.layout.micro_batch, -1), waited

    def close(self) -> None:
        ray.kill(self.reader)
