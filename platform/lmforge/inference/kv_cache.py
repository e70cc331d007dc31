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
        self.positions = self.mask = None
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
        sees = (causal[None] & real[:, None, :]) | (slots[None, :] == queries[:, None])[None]
        self.mask = sees[:, None]  # (batch, 1, new, end), broadcast over heads
        self._new = new

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
