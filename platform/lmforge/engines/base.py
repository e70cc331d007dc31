"""The engine interface: build a parallel model and optimizer, take a step, expose state.

The trainer, checkpointing and tracking only ever talk to this interface, so a
new engine (DeepSpeed) is one more file; what a step minimises is the `Loss` it holds.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from lmforge.checkpoint.state import TrainerState
from lmforge.engines.loss import LossInputs


@dataclass
class StepStats:
    loss: float  # mean token loss over the global batch
    grad_norm: float  # global L2 norm before clipping
    lr: float  # learning rate used for this step
    bubble: Optional[float] = None  # pipelines: measured share of idle time per rank
    bubble_theory: Optional[float] = None  # pipelines: the schedule's (p-1)/(v*m+p-1)
    finite: bool = True  # loss and gradient norm both finite
    update_skipped: bool = False  # the engine left the weights as they were (non-finite)
    overflow: bool = False  # fp16: the gradients overflowed at the loss scale (skipped, the scale halved), the loss finite
    loss_scale: Optional[float] = None  # fp16: the scale this step's loss was multiplied by
    next_loss_scale: Optional[float] = None  # fp16: the scale the next step uses
    terms: dict = field(default_factory=dict)  # the loss's named terms (a distillation's ce_loss, kd_loss, hidden_loss), each over the global batch


class Engine(ABC):
    # "dcp": the checkpoint is `state_dict()` saved with torch.distributed.checkpoint;
    # otherwise the engine writes and reads its own files with `save` and `load`.
    checkpoint_format = "dcp"

    @abstractmethod
    def train_step(
        self,
        micro_batches: torch.Tensor,
        before_update: Callable[[], None] = lambda: None,
        loss_mask: Optional[torch.Tensor] = None,
        loss_inputs: LossInputs = None,
    ) -> StepStats:
        """One optimizer step over this rank's micro-batches [accum, micro, seq_len+1].
        `before_update` runs after the backward passes, before any weight or optimizer
        state changes (a checkpoint's background copy must have finished by then).
        `loss_mask` [accum, micro, seq_len]: only the next tokens it marks are learnt,
        the loss their mean over the global batch (an instruction dataset's answers).
        `loss_inputs`: what the engine's `Loss` reads beside the tokens (its
        `step_inputs`), passed on untouched."""

    def eval_loss(self, micro_batches: torch.Tensor, loss_mask: Optional[torch.Tensor] = None) -> float:
        """The mean token cross-entropy of one held-out global batch, forward only (this
        rank's micro-batches [accum, micro, seq_len+1]); the same number on every rank."""
        raise NotImplementedError(f"{type(self).__name__} does not evaluate")

    def evaluate(self, micro_batches: torch.Tensor, loss_mask: Optional[torch.Tensor] = None, loss_inputs: LossInputs = None) -> dict[str, float]:
        """What one held-out global batch measures (this rank's micro-batches): its
        `eval_loss`, or the loss's own measures when it has them (a distillation's
        `eval_kl` and `eval_top1` beside it)."""
        return {"eval_loss": self.eval_loss(micro_batches, loss_mask)}

    def modules(self) -> list[torch.nn.Module]:
        """The model's modules on this rank (pipeline stages, or the one model)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its modules")

    # One pair of these, by `checkpoint_format`:
    def state_dict(self) -> tuple[dict, dict]:
        """dcp: (sharded tensors for DCP, JSON-safe rest such as the LR schedule)."""
        raise NotImplementedError(f"{type(self).__name__} checkpoints with save()/load()")

    def load_state_dict(self, tensors: dict, plain: dict) -> None:
        """dcp: inverse of `state_dict`, into the already-parallelized model; `tensors`
        is the template from `state_dict()` filled in by DCP."""
        raise NotImplementedError(f"{type(self).__name__} checkpoints with save()/load()")

    def save(self, directory: str) -> None:
        """Own format: write this rank's files into the step directory."""
        raise NotImplementedError(f"{type(self).__name__} checkpoints with state_dict()")

    def load(self, directory: str, saved: TrainerState) -> None:
        """Own format: restore from a step directory; `saved` is its state.json."""
        raise NotImplementedError(f"{type(self).__name__} checkpoints with state_dict()")


def warmup_cosine(warmup: int, decay_steps: int, min_ratio: float):
    """LR multiplier: linear warmup to 1, then cosine down to `min_ratio` at `decay_steps`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, decay_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
