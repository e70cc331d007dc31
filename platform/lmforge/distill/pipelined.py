"""The distillation objective as a pipeline schedule's loss function, on the last
stage, with the teacher's targets from the offline cache.

A schedule splits one target tensor into micro-batches and calls the loss with each
part, so every row of the target carries its index in the step's batch beside its
next tokens; the loss finds that row's cached top-k targets through it, whatever
order the schedule runs the micro-batches in.
"""

from __future__ import annotations

from typing import Optional

import torch

from lmforge.distill.losses import TopK, stored_top_k
from lmforge.distill.objective import DistillObjective


class StagedObjective:
    def __init__(self, objective: DistillObjective, microbatches: int):
        self.objective, self.microbatches = objective, microbatches
        self.cached: Optional[TopK] = None
        self.held_out = False
        self.learnt: Optional[torch.Tensor] = None
        # Per micro-batch (by its first row): torch calls the loss once more for a
        # micro-batch when it infers backward metadata after a switch from eval() to
        # training, and that call must not count twice.
        self.results: dict[int, torch.Tensor] = {}

    def target(self, tokens: torch.Tensor) -> torch.Tensor:
        """The schedule's target for a step's flattened batch of next tokens [rows, seq]:
        each row prefixed by its index."""
        rows = torch.arange(tokens.shape[0], device=tokens.device, dtype=tokens.dtype)
        return torch.cat([rows[:, None], tokens], dim=1)

    def begin(
        self, cached: Optional[tuple[torch.Tensor, torch.Tensor]], device: torch.device, held_out: bool = False, learnt: Optional[torch.Tensor] = None
    ) -> None:
        """A step's (or a held-out batch's) cached targets, [accum, micro, seq, k] each;
        `learnt`: a masked step's N / dp."""
        self.cached = None if cached is None else stored_top_k(*(t.flatten(0, 1).to(device, non_blocking=True) for t in cached))
        self.held_out, self.learnt, self.results = held_out, learnt, {}

    def totals(self, size: int, device: torch.device) -> torch.Tensor:
        """The terms (in `term_names` order), or the held-out sums, over the micro-batches
        this rank scored; zeros on a rank without the last stage."""
        return sum(self.results.values(), torch.zeros(size, device=device))

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        rows, tokens = target[:, 0], target[:, 1:]
        teacher = None if self.cached is None else self.cached.rows(rows)  # none: answers alone (an instruction dataset's)
        if self.held_out:
            self.results[int(rows[0])] = self.objective.held_out_sums(logits, tokens, teacher)
            return torch.zeros((), device=logits.device)
        loss, terms = self.objective(logits, tokens, teacher, learnt=self.learnt)
        self.results[int(rows[0])] = torch.stack([terms[name].detach() for name in self.objective.term_names])
        # The objective divides by the step's tokens; the schedule averages over its
        # micro-batches (it scales the gradients by 1/microbatches) as for cross-entropy.
        return loss * self.microbatches
