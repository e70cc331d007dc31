"""The loss is a component the engine holds: the engine runs forward, backward and
the optimizer under its parallelism and asks its `Loss` what a micro-batch costs.
The default is cross-entropy on the next tokens (those a loss mask marks); a
distillation brings its own (`lmforge.distill.loss`), and engines know nothing of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

LossInputs = Any  # what a loss reads beside the tokens (a distillation's cached targets, a rollout); the engine passes it on


@dataclass
class Placement:
    """Where the engine put the student: what a loss needs to build models beside it
    and reduce over the right ranks."""

    device: torch.device
    parallelize: Callable[[nn.Module], nn.Module]  # the engine's own path for a module the student's size (a teacher)
    tp_group: Optional[dist.ProcessGroup] = None  # the logits are vocabulary-sharded over it
    pipelined: bool = False  # the schedule calls `stage_loss` on the last stage
    grad_accum: int = 1


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Over every position; IGNORE_INDEX labels add nothing. Under loss_parallel the
    vocabulary-sharded logits are reduced without being gathered."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction=reduction)


class Loss:
    """What a step minimises. `__call__` runs the student's forward itself, so a loss
    may read what the forward recorded (intermediate layers) or score the same inputs
    with other models."""

    measures_held_out = False  # True: `evaluate` is this loss's held-out measures, else the held-out cross-entropy
    held_out_size = 0

    @property
    def term_names(self) -> list[str]:
        """The named terms each micro-batch reports (summed over the step)."""
        return []

    def build(self, placement: Placement) -> None:
        """Before the student is parallelized (a teacher sizes the student's adapters)."""

    def trainable_modules(self) -> dict[str, nn.Module]:
        """Modules trained, sharded and checkpointed with the student (attributes of its
        first part, parallelized beside its blocks)."""
        return {}

    def bind(self, student: nn.Module) -> None:
        """The student's first part as parallelized (hooks go on it)."""

    def step_inputs(self, step: int, sample_ids, targets) -> LossInputs:
        """This loss's inputs for one step, from the feed's sample ids and targets."""
        return None

    def held_out_inputs(self, targets) -> LossInputs:
        return None

    def row_fields(self, inputs: LossInputs) -> dict:
        """Fields a step's metrics line adds for these inputs."""
        return {}

    def rewrites(self, inputs: LossInputs) -> bool:
        """Whether `rewrite` replaces the step's tokens (the engine then gathers the weights for generation)."""
        return False

    def rewrite(
        self, model: nn.Module, micro_batches: torch.Tensor, loss_mask: Optional[torch.Tensor], inputs: LossInputs
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return micro_batches, loss_mask

    def __call__(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        index: int,
        learnt: Optional[torch.Tensor],
        accum: int,
        loss_inputs: LossInputs,
    ) -> tuple[torch.Tensor, dict]:
        """(micro-batch `index`'s share of the step's loss on this rank, its terms).
        `learnt`: a masked step's N / dp (each micro-batch's sum over it), else None
        (every micro-batch holds as many tokens: its mean over `accum`)."""
        raise NotImplementedError

    # A pipeline schedule calls one loss function per micro-batch, on the last stage.
    def stage_begin(self, inputs: LossInputs, device: torch.device, learnt: Optional[torch.Tensor], held_out: bool = False) -> None:
        self.learnt = learnt

    def stage_target(self, labels: torch.Tensor) -> torch.Tensor:
        """The schedule's target for the step's flattened labels [rows, seq]."""
        return labels

    def stage_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def stage_totals(self, size: int, device: torch.device) -> torch.Tensor:
        """The terms (or held-out sums) the last stage added up; zeros elsewhere."""
        return torch.zeros(size, device=device)

    # Held-out measures, when `measures_held_out`.
    def held_out_sums(self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, index: int, loss_inputs: LossInputs) -> torch.Tensor:
        raise NotImplementedError

    def held_out_means(self, sums: torch.Tensor, dp_group=None) -> dict[str, float]:
        raise NotImplementedError


class CrossEntropy(Loss):
    """The next tokens' cross-entropy, its mean over the global batch's learnt tokens."""

    def __init__(self):
        self.learnt: Optional[torch.Tensor] = None
        self.grad_accum = 1

    def build(self, placement: Placement) -> None:
        self.grad_accum = placement.grad_accum

    def __call__(self, model, inputs, labels, index, learnt, accum, loss_inputs=None):
        logits = model(inputs)
        if learnt is None:  # the mean of micro-batch means is the global-batch mean; data parallelism averages
            return cross_entropy(logits, labels) / accum, {}
        return cross_entropy(logits, labels, "sum") / learnt, {}  # micro-batches hold different counts

    def stage_loss(self, logits, target):
        if self.learnt is None:
            return cross_entropy(logits, target)
        # The schedule averages its micro-batches' losses: each one's sum over N / dp, times their count.
        return cross_entropy(logits, target, "sum") / self.learnt * self.grad_accum
