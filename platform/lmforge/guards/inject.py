"""Fault injection from the job's `debug` section, to see the guards act: a NaN
or spiking loss at chosen steps, gradients that overflow at others, an out-of-memory
error while the micro-batch is above a size, one tensor leaked per step, a rank
that dawdles before chosen steps."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lmforge.engines.base import Engine
    from lmforge.spec import JobSpec

SPIKE_FACTOR = 30.0  # logits this much larger: a loss far above any recent one


class FaultInjector:
    def __init__(self, spec: JobSpec, engine: Engine, rank: int):
        self.debug, self.rank, self.micro_batch = spec.debug, rank, spec.train.micro_batch
        self.poison: float | None = None  # what this step's outputs are multiplied by
        self.overflow = False  # this step's outputs pass infinite gradients back
        self.leaked: list[torch.Tensor] = []
        if self.debug.nan_at_steps or self.debug.spike_at_steps or self.debug.overflow_at_steps:
            for module in engine.modules():
                module.register_forward_hook(self._poison_output)

    def before_step(self, step: int) -> None:
        """`step`: the number the step about to run will report."""
        d = self.debug
        if d.oom_at_step == step and self.rank == 0 and self.micro_batch > d.oom_above_micro_batch:
            raise torch.OutOfMemoryError(f"injected by debug.oom_at_step={step} (micro-batch {self.micro_batch} > {d.oom_above_micro_batch})")
        if self.rank == d.slow_rank and step in d.slow_at_steps:
            time.sleep(d.slow_s)
        self.poison = float("nan") if step in d.nan_at_steps else SPIKE_FACTOR if step in d.spike_at_steps else None
        self.overflow = step in d.overflow_at_steps

    def after_step(self) -> None:
        if self.debug.leak_per_step:
            self.leaked.append(torch.ones(256))

    def _poison_output(self, module, args, output):
        if not isinstance(output, torch.Tensor):
            return None
        if self.overflow:
            return _InfiniteGradient.apply(output)
        return output * self.poison if self.poison is not None else None


class _InfiniteGradient(torch.autograd.Function):
    """The identity forward; backward, a gradient too large for any float."""

    @staticmethod
    def forward(ctx, output):
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")
