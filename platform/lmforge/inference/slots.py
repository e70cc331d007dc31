"""The KV cache continuous batching decodes over: a fixed number of slots, each one
sequence's keys and values from position 0, so a sequence can join (prefill into a
free slot) or leave (free its slot) between any two decode steps.

A forward runs over some of the slots (`rows`): a prompt into one slot, or one new
token for each running sequence, each at its own length.
"""

from __future__ import annotations

import torch

from lmforge.inference.kv_cache import LayerCache
from lmforge.models.config import ModelConfig


class SlotCache:
    def __init__(self, cfg: ModelConfig, slots: int, capacity: int, device: torch.device):
        self.keys: list = [None] * cfg.n_layers
        self.values: list = [None] * cfg.n_layers
        self.slots, self.capacity, self.device = slots, capacity, device
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)
        self.rows = self.positions = self.mask = None
        self._end = 0
        self._windowed: dict[int, torch.Tensor] = {}
        self._layers = [SlotLayer(self, i) for i in range(cfg.n_layers)]

    def begin(self, rows: list[int], new: int) -> None:
        """Before a forward of `new` tokens for each slot in `rows` (a prompt: one row)."""
        if new > 1 and len(rows) != 1:
            raise ValueError("several tokens are written into one slot at a time")
        self.rows = torch.tensor(rows, device=self.device)
        starts = self.lengths[self.rows]
        self.positions = starts[:, None] + torch.arange(new, device=self.device)[None, :]
        self._end = int(self.positions.max()) + 1
        if self._end > self.capacity:
            raise ValueError(f"a slot holds {self.capacity} positions; {self._end} asked")
        slots = torch.arange(self._end, device=self.device)
        # A query sees its own sequence's slots up to its position: what was written
        # there by an earlier sequence is past the current length, so never seen.
        self.mask = (slots[None, None, :] <= self.positions[:, :, None])[:, None]  # (rows, 1, new, end)
        self._windowed = {}

    def window_mask(self, window: int) -> torch.Tensor:
        """`mask`, less the slots `window` or more positions behind each query."""
        if window not in self._windowed:
            slots = torch.arange(self._end, device=self.device)
            self._windowed[window] = self.mask & ((self.positions[:, :, None] - slots[None, None, :]) < window)[:, None]
        return self._windowed[window]

    def advance(self) -> None:
        self.lengths[self.rows] += self.positions.shape[1]

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0

    def layer(self, index: int) -> "SlotLayer":
        return self._layers[index]


class SlotLayer(LayerCache):
    """What one attention layer sees of the slots: the cache's `mask`, and `update`."""

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the forward's keys and values (rows, kv_heads, new, head_dim); each row's all so far."""
        cache = self.cache
        if cache.keys[self.index] is None:
            shape = (cache.slots, k.shape[1], cache.capacity, k.shape[3])
            cache.keys[self.index], cache.values[self.index] = k.new_zeros(shape), v.new_zeros(shape)
        keys, values = cache.keys[self.index], cache.values[self.index]
        rows, positions = cache.rows, cache.positions
        if positions.shape[1] == 1:  # one token per row, each at its own position
            keys[rows, :, positions[:, 0]] = k[:, :, 0]
            values[rows, :, positions[:, 0]] = v[:, :, 0]
        else:
            first = int(positions[0, 0])
            keys[rows[0], :, first : first + k.shape[2]] = k[0]
            values[rows[0], :, first : first + k.shape[2]] = v[0]
        return keys[rows, :, : cache._end], values[rows, :, : cache._end]
