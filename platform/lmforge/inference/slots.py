"""The KV cache continuous batching decodes over: a fixed number of slots, each one
sequence's keys and values from position 0, so a sequence can join (prefill into a
free slot) or leave (free its slot) between any two decode steps.

A forward runs over some of the slots (`rows`): a prompt into one slot, or one new
token for each running sequence, each at its own length. Each slot remembers which
tokens it holds, kept after it is freed until it is written again, so a prompt that
begins with what a slot holds (a system prompt, a sibling choice, the previous turn)
copies those positions instead of computing them again (`longest_prefix`, `reuse`).
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
        self.held: list[list[int]] = [[] for _ in range(slots)]  # each slot's tokens from position 0
        self._tokens: list[list[int]] = []
        self.rows = self.positions = self.mask = None
        self._end = 0
        self._windowed: dict[int, torch.Tensor] = {}
        self._layers = [SlotLayer(self, i) for i in range(cfg.n_layers)]

    def begin(self, rows: list[int], tokens: torch.Tensor) -> None:
        """Before a forward of `tokens` (rows, new) into the slots `rows` (a prompt: one row)."""
        new = tokens.shape[1]
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
        self._tokens = tokens.tolist()

    def window_mask(self, window: int) -> torch.Tensor:
        """`mask`, less the slots `window` or more positions behind each query."""
        if window not in self._windowed:
            slots = torch.arange(self._end, device=self.device)
            self._windowed[window] = self.mask & ((self.positions[:, :, None] - slots[None, None, :]) < window)[:, None]
        return self._windowed[window]

    def advance(self) -> None:
        self.lengths[self.rows] += self.positions.shape[1]
        for row, tokens in zip(self.rows.tolist(), self._tokens):
            self.held[row] += tokens

    def free(self, slot: int) -> None:
        """The slot takes another sequence; what it holds stays for `reuse` until then."""
        self.lengths[slot] = 0

    def longest_prefix(self, prompt: list[int], among: list[int]) -> tuple[int, int]:
        """(slot, length): the slot among `among` holding the longest beginning of
        `prompt`, less its last token (whose logits a prefill must compute)."""
        best, length = -1, 0
        for slot in among:
            shared = _common_length(self.held[slot], prompt, len(prompt) - 1)
            if shared > length:
                best, length = slot, shared
        return best, length

    def reuse(self, slot: int, source: int, length: int) -> None:
        """`slot` holds the first `length` positions of `source` (itself, or a copy)."""
        if source != slot:
            for cached in (*self.keys, *self.values):
                if cached is not None:
                    cached[slot, :, :length] = cached[source, :, :length]
        self.held[slot] = self.held[source][:length]
        self.lengths[slot] = length

    def layer(self, index: int) -> "SlotLayer":
        return self._layers[index]


def _common_length(held: list[int], prompt: list[int], limit: int) -> int:
    """How many first tokens `held` and `prompt` share, at most `limit`."""
    n = min(len(held), limit)
    if held[:n] == prompt[:n]:
        return n
    low, high = 0, n  # held[:low] matches, held[:high] does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if held[:middle] == prompt[:middle] else (low, middle)
    return low


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
