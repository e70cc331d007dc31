"""What a serving replica holds: the model's weights and its KV cache, one slot per
sequence decoding together. A slot holds every layer's keys and values for the whole
context (the slot cache allocates sliding-window layers in full too), with the
model's key-value heads (GQA's fewer ones count as fewer)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from lmforge.errors import UserError
from lmforge.models.config import ModelConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
RESERVED_FRACTION = 0.1  # as training's plan: the allocator's fragmentation and the runtime's own


@dataclass(frozen=True)
class ServingMemory:
    weights: int
    kv_per_sequence: int  # keys and values of one full-context sequence, every layer
    sequences: int  # slots: sequences decoding together
    context: int

    @property
    def kv_cache(self) -> int:
        return self.kv_per_sequence * self.sequences

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache

    def sequences_that_fit(self, memory: int) -> int:
        """Full-context slots beside the weights in `memory` (90% of it counted usable)."""
        return max(0, (int(memory * (1 - RESERVED_FRACTION)) - self.weights) // self.kv_per_sequence)

    def as_dict(self) -> dict:
        return asdict(self) | {"kv_cache": self.kv_cache, "total": self.total}


def serving_memory(cfg: ModelConfig, dtype: str, sequences: int, context: Optional[int] = None, weights: Optional[int] = None) -> ServingMemory:
    """`weights`: the bytes as stored where they are not `dtype`'s (a quantized model)."""
    width = DTYPE_BYTES[dtype]
    context = context or cfg.max_seq_len
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * width
    return ServingMemory(weights if weights is not None else cfg.num_params() * width, per_token * context, sequences, context)


def size_slots(plan: ServingMemory, memory: int, flag: str) -> int:
    """The slots a replica of `memory` bytes can give (at most the plan's); refused
    where it cannot hold the weights and one full-context sequence, with the numbers."""
    fit = plan.sequences_that_fit(memory)
    if fit < 1:
        raise UserError(
            f"{flag}: {memory / 2**30:.2f} GiB ({1 - RESERVED_FRACTION:.0%} usable) cannot hold the weights "
            f"({plan.weights / 2**30:.2f} GiB) and one sequence's KV cache over the model's {plan.context} positions "
            f"({plan.kv_per_sequence / 2**30:.2f} GiB)"
        )
    return min(fit, plan.sequences)
