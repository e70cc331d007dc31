"""A distillation job's loss as the component an engine holds: its online teachers
(built through the engine's own parallelize step), hidden-state adapters trained
with the student, on-policy rollouts, the pipeline-stage variant and the held-out
measures. The engine knows none of them; `DistillObjective` does the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import nn

from lmforge.data import storage
from lmforge.distill.cross_tokenizer import AlignedTeacher, aligned_top_k
from lmforge.distill.hidden import ADAPTERS, BlockOutputs, HiddenAdapters
from lmforge.distill.objective import HELD_OUT_SUMS, DistillObjective, compared_vocab
from lmforge.distill.on_policy import OnPolicy, Rollout
from lmforge.distill.pipelined import StagedObjective
from lmforge.distill.teacher import Cached, aligned_teachers, build_teacher, micro_batch, teacher_shapes, teacher_targets
from lmforge.engines.loss import Loss, Placement


@dataclass
class DistillInputs:
    """What a step (or a held-out batch) learns from beside its tokens."""

    cached: Cached = None  # the offline cache's top-k ids and log-probabilities [accum, micro, seq, k]
    rollout: Optional[Rollout] = None  # an on-policy step's: the student writes the tokens first


def cached_tensors(targets) -> Cached:
    """The feed's top-k ids and log-probabilities (numpy) as tensors; None without a cache."""
    if targets is None:
        return None
    ids, logprobs = targets
    return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(logprobs.astype(np.float32))


class DistillLoss(Loss):
    measures_held_out = True
    held_out_size = HELD_OUT_SUMS

    def __init__(self, spec, vocab: Optional[int] = None, eos: int = 0, tokenizer: Optional[str] = None):
        """`vocab`: the tokenizer's real vocabulary (the divergence compares no more of it);
        `tokenizer`: its tokenizer.json, which teachers of another tokenizer read the text through."""
        self.spec, self.vocab, self.tokenizer = spec, vocab, tokenizer
        self.settings = spec.distill
        self.on_policy = OnPolicy(spec, eos) if self.settings.on_policy else None
        self.teachers: list[nn.Module] = []
        self.aligned: list[AlignedTeacher] = []
        self.hidden: Optional[tuple[BlockOutputs, BlockOutputs]] = None
        self.staged: Optional[StagedObjective] = None

    def build(self, placement: Placement) -> None:
        """Before the student: online teachers through the engine's own parallelize step
        (from an offline cache there are none: its targets come with the batches)."""
        self.device = placement.device
        if self.settings.online:
            self.teachers = [build_teacher(source.path, placement.device, placement.parallelize) for source in self.settings.sources]
        if self.teachers and self.settings.cross_tokenizer is not None:
            if self.tokenizer is None:
                raise ValueError("distill.cross_tokenizer: the student's tokenizer.json was not given to the loss")
            student = Tokenizer.from_str(storage.read_text(self.tokenizer, "data.path"))
            self.aligned = aligned_teachers(self.teachers, self.settings, student)
        train = self.spec.train
        self.objective = DistillObjective(
            self.spec,
            self.spec.grad_accum * train.micro_batch * train.seq_len,
            # Teachers of another tokenizer are projected onto the student's whole vocabulary.
            compared_vocab(self.spec, self.vocab, [] if self.settings.cross_tokenizer else self.teachers),
            placement.tp_group,
        )
        if placement.pipelined:  # from the cache: the last stage computes it, as the schedule's loss
            self.staged = StagedObjective(self.objective, placement.grad_accum)

    @property
    def term_names(self) -> list[str]:
        return self.objective.term_names

    def trainable_modules(self) -> dict[str, nn.Module]:
        hidden = self.settings.hidden
        if hidden is None:
            return {}
        teacher_width = teacher_shapes(self.settings)[0].dim  # the spec allows hidden states with one teacher
        adapters = HiddenAdapters(hidden.layers, self.spec.model_arch.dim, teacher_width, seed=self.spec.train.seed)
        return {ADAPTERS: adapters.to(self.device)}

    def bind(self, student: nn.Module) -> None:
        """Hooks go on the blocks as parallelized (an activation-checkpointing wrapper records once)."""
        hidden = self.settings.hidden
        if hidden is not None:
            self.hidden = (BlockOutputs(student, hidden.layers), BlockOutputs(self.teachers[0], hidden.layers.values()))

    def step_inputs(self, step: int, sample_ids, targets) -> DistillInputs:
        rollout = self.on_policy.for_step(step, sample_ids) if self.on_policy else None
        return DistillInputs(cached=cached_tensors(targets), rollout=rollout)

    def held_out_inputs(self, targets) -> DistillInputs:
        return DistillInputs(cached=cached_tensors(targets))

    def row_fields(self, inputs: Optional[DistillInputs]) -> dict:
        if self.on_policy is None:
            return {}
        return {"on_policy": int(inputs is not None and inputs.rollout is not None)}  # the step learnt the student's own continuations

    def rewrites(self, inputs: Optional[DistillInputs]) -> bool:
        return inputs is not None and inputs.rollout is not None

    def rewrite(self, model, micro_batches, loss_mask, inputs: DistillInputs):
        """The student's continuations replace the data's; the online teachers score them."""
        if inputs.rollout is None:
            return micro_batches, loss_mask
        return inputs.rollout.continue_prompts(model, micro_batches, loss_mask, self.objective.vocab, self.objective.tp_group)

    def __call__(self, model, inputs, labels, index, learnt, accum, loss_inputs: Optional[DistillInputs] = None):
        on_policy = self.rewrites(loss_inputs)
        cached = None if on_policy or loss_inputs is None else micro_batch(loss_inputs.cached, index)
        logits, teacher = model(inputs), self._targets(inputs, cached)
        hidden = None
        if self.hidden is not None:
            student_side, teacher_side = self.hidden
            layers = self.settings.hidden.layers
            adapted = list(getattr(model, ADAPTERS)(*student_side.take(layers)))
            hidden = (adapted, teacher_side.take(layers.values()))
        # Each term is divided by the tokens this rank trains on per step (see DistillObjective).
        return self.objective(logits, labels, teacher, hidden, learnt, on_policy)

    def _targets(self, inputs: torch.Tensor, cached: Cached):
        """The online teachers' logits, the cache's top-k, or (teachers of another
        tokenizer) their top-k projected onto the student's vocabulary where aligned."""
        if cached is None and self.aligned:
            s = self.settings
            return aligned_top_k(self.aligned, inputs, s.temperature, s.top_k, self.objective.vocab)
        return teacher_targets(self.teachers, inputs, cached, self.device)

    @property
    def _stage(self) -> StagedObjective:
        if self.staged is None:
            raise RuntimeError("a pipeline stage's loss asked of an engine without pipeline parallelism")
        return self.staged

    def stage_begin(self, inputs, device, learnt, held_out=False) -> None:
        self._stage.begin(None if inputs is None else inputs.cached, device, held_out=held_out, learnt=learnt)

    def stage_target(self, labels):
        return self._stage.target(labels)

    def stage_loss(self, logits, target):
        return self._stage(logits, target)

    def stage_totals(self, size, device):
        return self._stage.totals(size, device)

    def held_out_sums(self, model, inputs, labels, index, loss_inputs: Optional[DistillInputs] = None) -> torch.Tensor:
        cached = None if loss_inputs is None else micro_batch(loss_inputs.cached, index)
        sums = self.objective.held_out_sums(model(inputs), labels, self._targets(inputs, cached))
        for side in self.hidden or ():  # what the forwards recorded, no loss uses
            side.clear()
        return sums

    def held_out_means(self, sums, dp_group=None) -> dict[str, float]:
        return self.objective.held_out_means(sums, dp_group)
