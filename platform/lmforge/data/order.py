"""The global sample order and how each step's batch is split over DP ranks.

One global order of sample ids (seeded per epoch) defines every optimizer
step's global batch; a DP rank takes its contiguous slice of it and splits that
into micro-batches. The order depends on neither dp nor restarts, so the cursor
(samples consumed = step x global batch) is all a checkpoint needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_EPOCH_STRIDE = 1_000_003  # keeps (seed, epoch) streams apart for any seed


class GlobalOrder:
    """Maps global sample positions (0, 1, 2, ... over all epochs) to sample ids.

    Each epoch permutes blocks of `block` consecutive samples (one Parquet shard
    each) over the whole dataset, then permutes samples inside windows of `window`
    blocks. Reading an epoch is thus a stream of whole shards in block order,
    with a bounded shuffle buffer; the order is a pure function of
    (seed, epoch, dataset size) and so is the same for every dp.
    """

    def __init__(self, num_samples: int, seed: int, block: int = 256, window: int = 16):
        self.num_samples, self.seed, self.block, self.window = num_samples, seed, block, window
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._windows: dict[tuple[int, int], np.ndarray] = {}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(block order, first position of each window) for one epoch."""
        if epoch not in self._epochs:
            if len(self._epochs) > 2:
                self._epochs.clear()
                self._windows.clear()
            n_blocks = -(-self.num_samples // self.block)
            blocks = np.random.default_rng([self.seed, epoch, _EPOCH_STRIDE]).permutation(n_blocks)
            sizes = np.minimum(self.block, self.num_samples - blocks * self.block)
            window_sizes = np.add.reduceat(sizes, np.arange(0, n_blocks, self.window))
            self._epochs[epoch] = (blocks, np.concatenate([[0], np.cumsum(window_sizes)]))
        return self._epochs[epoch]

    def blocks(self, epoch: int) -> np.ndarray:
        return self._epoch(epoch)[0]

    def locate(self, position: int) -> tuple[int, int]:
        """(epoch, window index) holding a global position."""
        epoch, offset = divmod(position, self.num_samples)
        _, window_starts = self._epoch(epoch)
        return epoch, int(np.searchsorted(window_starts, offset, side="right") - 1)

    def window_ids(self, epoch: int, index: int) -> np.ndarray:
        return self._window_ids(epoch, index)

    def _window_ids(self, epoch: int, index: int) -> np.ndarray:
        key = (epoch, index)
        if key not in self._windows:
            blocks, _ = self._epoch(epoch)
            members = blocks[index * self.window : (index + 1) * self.window]
            ids = np.concatenate([np.arange(b * self.block, min((b + 1) * self.block, self.num_samples)) for b in members])
            rng = np.random.default_rng([self.seed, epoch, index])
            self._windows[key] = ids[rng.permutation(len(ids))]
        return self._windows[key]

    def ids(self, start: int, count: int) -> np.ndarray:
        positions = np.arange(start, start + count)
        epochs, offsets = np.divmod(positions, self.num_samples)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            _, window_starts = self._epoch(int(epoch))
            windows = np.searchsorted(window_starts, offsets[in_epoch], side="right") - 1
            picked = np.empty(int(in_epoch.sum()), dtype=np.int64)
            for w in np.unique(windows):
                mask = windows == w
                picked[mask] = self._window_ids(int(epoch), int(w))[offsets[in_epoch][mask] - window_starts[w]]
            out[in_epoch] = picked
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
