"""Choosing the next token from logits: repetition penalty, then temperature, top-k
and top-p (the order transformers applies them in), or greedy at temperature 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from lmforge.errors import UserError

# The ranges a setting is checked against before it reaches a decode step (which, in a
# server, other requests share): outside them the arithmetic overflows or seeding fails.
MAX_SEED = 2**63 - 1  # a sequence's generator is seeded with seed + its index
PENALTY_RANGE = (0.01, 100.0)
MAX_TEMPERATURE = 100.0
GREEDY_BELOW = 1e-5  # a temperature this small samples as greedy (vLLM's rule): dividing by it overflows


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)  # strings that end a sequence (not included in its text)
    stop_at_eos: bool = True

    def check(self, names: Optional[dict] = None) -> None:
        """UserError naming the option (`names`: option -> what the user typed, e.g. a flag)."""

        def name(key):
            return (names or {}).get(key, key)

        if self.max_new_tokens < 1:
            raise UserError(f"{name('max_new_tokens')}: must be at least 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # NaN fails every comparison
            raise UserError(f"{name('temperature')}: must be from 0 (greedy) to {MAX_TEMPERATURE:g}, got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"{name('top_k')}: must be >= 0 (0 keeps every token), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"{name('top_p')}: must be in (0, 1], got {self.top_p}")
        low, high = PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise UserError(f"{name('repetition_penalty')}: must be from {low:g} to {high:g} (1 is none), got {self.repetition_penalty}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise UserError(f"{name('seed')}: must be from 0 to 2**63-1, got {self.seed}")
        if any(not s for s in self.stop):
            raise UserError(f"{name('stop')}: an empty stop string would stop at once")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or (math.isfinite(self.temperature) and self.temperature < GREEDY_BELOW)


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """`seen` (batch, vocab) marks tokens already in each sequence: their logits are
    divided by the penalty when positive, multiplied when negative (CTRL's rule)."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def keep_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """The smallest set of most likely tokens whose probability reaches p (at least one)."""
    if p >= 1.0:
        return logits
    ordered, order = logits.sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    beyond = probs.cumsum(dim=-1) - probs > p  # the mass before a token already reaches p
    beyond[..., 0] = False
    return logits.masked_fill(beyond.scatter(-1, order, beyond), float("-inf"))


def next_tokens(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """One token per sequence from fp32 logits (batch, vocab)."""
    logits = penalize_repeats(logits, seen, params.repetition_penalty)
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = keep_top_p(keep_top_k(logits / params.temperature, params.top_k), params.top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)
