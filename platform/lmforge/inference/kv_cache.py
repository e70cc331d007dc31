"""The KV cache a `Transformer` forward writes into and attends over: every layer's
keys and values for a batch of left-padded sequences, preallocated once.

Each sequence counts its positions from its first real token, so a padded prompt
generates exactly what it would alone.
"""

from __future__ import annotations

import torch

from lmforge.models.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, pad: torch.Tensor, capacity: int, device: torch.device):
        """`pad[b]`: how many padding slots precede sequence b; `capacity`: slots per sequence.
        A layer's slots are allocated at its first keys, with their heads and dtype (a
        tensor-parallel rank's share of the heads; a mixed-precision forward's dtype)."""
        self.keys: list = [None] * cfg.n_layers
        self.values: list = [None] * cfg.n_layers
        self.pad = pad.to(device)
        self.capacity = capacity
        self.length = 0  # slots filled
        self._new = 0
        self.positions = self.mask = self._key_positions = self._own = None
        self._windowed: dict[int, torch.Tensor] = {}
        self._layers = [LayerCache(self, i) for i in range(cfg.n_layers)]

    def begin(self, new: int) -> None:
        """Before a forward of `new` tokens per sequence: their positions, and which
        slots each of them sees (earlier real tokens and itself)."""
        end = self.length + new
        if end > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} positions; {end} asked")
        slots = torch.arange(end, device=self.pad.device)
        queries = slots[self.length :]
        self.positions = (queries[None, :] - self.pad[:, None]).clamp(min=0)
        causal = slots[None, :] <= queries[:, None]
        real = slots[None, :] >= self.pad[:, None]
        # A padding slot sees itself: no query attends to nothing (a NaN softmax).
        own = (slots[None, :] == queries[:, None])[None]
        sees = (causal[None] & real[:, None, :]) | own
        self.mask = sees[:, None]  # (batch, 1, new, end), broadcast over heads
        self._key_positions, self._own, self._windowed = slots[None, :] - self.pad[:, None], own, {}
        self._new = new

    def window_mask(self, window: int) -> torch.Tensor:
        """`mask`, less the keys `window` or more positions behind each query (a sliding
        window's layer); computed once per forward."""
        if window not in self._windowed:
            near = (self.positions[:, :, None] - self._key_positions[:, None, :]) < window
            self._windowed[window] = ((self.mask[:, 0] & near) | self._own)[:, None]
        return self._windowed[window]

    def advance(self) -> None:
        """After the forward: its keys and values are part of the cache."""
        self.length += self._new
        self._new = 0

    def layer(self, index: int) -> "LayerCache":
        return self._layers[index]


class LayerCache:
    """What one attention layer sees of the cache: `update` and `mask`."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    @property
    def mask(self) -> torch.Tensor:
        return self.cache.mask

    def mask_for(self, window: int) -> torch.Tensor:
        """What each query sees: every earlier position, or (a sliding `window` > 0) the
        last `window` up to its own, as transformers' sliding-window layers."""
        return self.cache.window_mask(window) if window else self.cache.mask

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's keys and values (batch, kv_heads, new, head_dim); all so far."""
        cache, start = self.cache, self.cache.length
        end = start + k.shape[2]
        if cache.keys[self.index] is None:
            shape = (k.shape[0], k.shape[1], cache.capacity, k.shape[3])
            cache.keys[self.index], cache.values[self.index] = k.new_zeros(shape), v.new_zeros(shape)
        keys, values = cache.keys[self.index], cache.values[self.index]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]
