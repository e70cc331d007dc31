"""Pipeline parallelism with torch.distributed.pipelining.

The model is cut into `pp x virtual_stages` contiguous stages balanced by FLOPs
(embedding lookup free, each block its matmuls and attention, the output head
its vocabulary projection). Each stage is the model with the parts it does not
own removed, so parameter names, and checkpoints, stay those of the whole model.
Stages time their own compute so each step can report its measured bubble.
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from functools import lru_cache

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from lmforge.models.config import ModelConfig

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleZBVZeroBubble,
}


class Stopwatch:
    """Sums the time spent inside `span()`; CUDA spans are timed with events on the
    current stream, so asynchronous kernels count when they run, not when queued."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list = []

    @contextmanager
    def span(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans.append((start, end))
        else:
            began = time.perf_counter()
            yield
            self.spans.append(time.perf_counter() - began)

    def take(self) -> float:
        """Seconds summed since the last call."""
        if self.cuda:
            if self.spans:
                self.spans[-1][1].synchronize()
            total = sum(start.elapsed_time(end) for start, end in self.spans) / 1e3
        else:
            total = sum(self.spans)
        self.spans = []
        return total


class TimedStage(PipelineStage):
    """A pipeline stage that adds the time of each forward and backward chunk to a
    stopwatch; time waiting for neighbours is left out, which is the bubble."""

    def __init__(self, *args, stopwatch: Stopwatch, **kwargs):
        super().__init__(*args, **kwargs)
        self.stopwatch = stopwatch

    def forward_one_chunk(self, *args, **kwargs):
        with self.stopwatch.span():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with self.stopwatch.span():
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        with self.stopwatch.span():
            return super().backward_weight_one_chunk(*args, **kwargs)

    # torch 2.13: in `eval()` a V schedule (zero-bubble) still runs its backward
    # actions, which skip the computation but hand gradients between a rank's two
    # adjacent stages, and the stages refuse that without a backward. Nothing to hand.
    def get_local_bwd_output(self, mb_index):
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index):
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


def theoretical_bubble(schedule: str, pp: int, virtual: int, microbatches: int) -> float:
    """(p-1)/(m+p-1) for GPipe and 1F1B; interleaving divides the warm-up by v.
    For zero-bubble the interleaved figure is shown as an upper bound."""
    v = 1 if schedule in ("gpipe", "1f1b") else virtual
    return (pp - 1) / (v * microbatches + pp - 1)


def layer_costs(cfg: ModelConfig, seq_len: int) -> tuple[float, float]:
    """(FLOPs per token of one block, of the output head)."""
    d, q, kv = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    block = 2 * (2 * d * q + 2 * d * kv + 3 * d * cfg.ffn_hidden) + 4 * seq_len * q
    return block, 2 * d * cfg.vocab_size


@lru_cache(maxsize=256)
def split_layers(cfg: ModelConfig, seq_len: int, num_stages: int) -> tuple[tuple[int, ...], ...]:
    """Contiguous block ranges per stage minimizing the costliest stage (the head
    counts towards the last stage); every stage gets at least one block. Cached:
    the memory planner asks for the same split for every layout it weighs."""
    block, head = layer_costs(cfg, seq_len)
    n = cfg.n_layers
    # best[s][i]: least max-cost of putting the first i blocks into s stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                cost = (i - j) * block + (head if s == num_stages and i == n else 0)
                value = max(best[s - 1][j], cost)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    ranges, i = [], n
    for s in range(num_stages, 0, -1):
        j = cut[s][i]
        ranges.append(tuple(range(j, i)))
        i = j
    return tuple(ranges[::-1])


def stage_indices(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """Which global stages a rank runs: looped (s, s+pp, ...) or, for ZBV, a V."""
    if schedule == "zero-bubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


FIRST_STAGE_PARTS, LAST_STAGE_PARTS = ("tok_embeddings",), ("norm", "output")


def in_stage(part: str, layers, first: bool, last: bool) -> bool:
    """Whether a stage keeps the model's top-level `part` ("layers.3", "norm", ...):
    its own blocks, the embedding on the first stage, the norm and head on the last."""
    if part.startswith("layers."):
        return int(part.split(".")[1]) in layers
    if part in FIRST_STAGE_PARTS:
        return first
    return last if part in LAST_STAGE_PARTS else True


def cut_stage(model: nn.Module, layers: list[int], first: bool, last: bool) -> nn.Module:
    """A copy of a meta-device model holding only `layers` (and embedding/head if owned)."""
    stage = copy.deepcopy(model)
    for name in list(stage.layers.keys()):
        if not in_stage(f"layers.{name}", layers, first, last):
            del stage.layers[name]
    for part in FIRST_STAGE_PARTS + LAST_STAGE_PARTS:
        if not in_stage(part, layers, first, last):
            setattr(stage, part, None)
    return stage


def build_schedule(stages: list[PipelineStage], name: str, microbatches: int, loss_fn):
    cls = SCHEDULES[name]
    if name in ("gpipe", "1f1b"):
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn)
