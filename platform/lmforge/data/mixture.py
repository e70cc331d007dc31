"""Weighted mixtures of prepared datasets (`data.sources`) in one deterministic order.

Global positions are cut into chunks of `CHUNK`; every chunk holds the same number
of samples of each source (the weights, rounded by largest remainder), in an order
shuffled per chunk from the seed. Each source is read in its own `GlobalOrder`, so
a source's n-th sample in the mixture is position n of its order: where a chunk
starts in every source is a product, and a resume at any step costs nothing to
find. The order depends on the seed and the weights only, never on dp.
"""

from __future__ import annotations

import numpy as np

CHUNK = 256  # positions per chunk: the realised mixture equals the rounded weights over each
ID_STRIDE = 1 << 40  # a mixture's sample id: source index x ID_STRIDE + the sample's id in its source
_MIX_STREAM = 7_000_003  # keeps the mixing stream apart from the sources' orders


def chunk_counts(weights: list[float], chunk: int = CHUNK) -> np.ndarray:
    """Samples of each source in every chunk: the weights' shares of `chunk`,
    rounded by largest remainder (ties to the earlier source)."""
    share = np.asarray(weights, dtype=np.float64) / float(np.sum(weights)) * chunk
    counts = np.floor(share).astype(np.int64)
    by_remainder = np.argsort(-(share - counts), kind="stable")
    counts[by_remainder[: chunk - counts.sum()]] += 1
    return counts


class Mixture:
    """Maps global positions to (source, position in that source's own order)."""

    def __init__(self, weights: list[float], seed: int, chunk: int = CHUNK):
        self.counts, self.seed, self.chunk = chunk_counts(weights, chunk), seed, chunk
        self._chunks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _chunk(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each slot, its rank among the chunk's slots of that source)."""
        if index not in self._chunks:
            if len(self._chunks) > 8:
                self._chunks.clear()
            labels = np.repeat(np.arange(len(self.counts)), self.counts)
            labels = labels[np.random.default_rng([self.seed, index, _MIX_STREAM]).permutation(self.chunk)]
            ranks = np.empty(self.chunk, dtype=np.int64)
            for source in range(len(self.counts)):
                where = labels == source
                ranks[where] = np.arange(int(where.sum()))
            self._chunks[index] = labels, ranks
        return self._chunks[index]

    def locate(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, position in the source's order) of global positions start..start+count-1.
        The positions one source gets in any run of global positions are consecutive."""
        positions = np.arange(start, start + count)
        chunks, slots = np.divmod(positions, self.chunk)
        sources, within = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
        for index in np.unique(chunks):
            mask = chunks == index
            labels, ranks = self._chunk(int(index))
            sources[mask] = labels[slots[mask]]
            within[mask] = int(index) * self.counts[sources[mask]] + ranks[slots[mask]]
        return sources, within

    def taken(self, start: int, count: int) -> np.ndarray:
        """Samples of each source among global positions start..start+count-1."""
        return np.bincount(self.locate(start, count)[0], minlength=len(self.counts))
