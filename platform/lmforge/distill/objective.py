"""A distillation job's loss for one micro-batch: the weighted sum of the
cross-entropy on the data, the divergence from the teacher and the distance of
matched intermediate layers, each term divided by the tokens a rank trains on per
step (FSDP then averages over ranks, so every term is its sum over the global batch
divided by N). On an instruction dataset only the answers' tokens count: the labels
carry the ignore index elsewhere, and N is counted per step.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from lmforge.distill.hidden import hidden_loss_sum
from lmforge.distill.losses import Divergence, Mixture, SumOfShares, TopK, kd_loss_sum, teacher_log_probs, top_k, within_vocab
from lmforge.engines.loss_mask import learnt_mask

TERMS = ("ce_loss", "kd_loss", "hidden_loss")
EVAL_METRICS = ("eval_loss", "eval_kl", "eval_top1")  # what `held_out_sums` adds up, in order,
HELD_OUT_SUMS = len(EVAL_METRICS) + 1  # and then the tokens it counted


def _local(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's own part: a vocabulary shard of the logits (the KD loss reduces over
    the TP group itself), or the replicated cross-entropy."""
    return value.to_local() if isinstance(value, DTensor) else value


def _cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed over the tokens; under loss_parallel a sharded DTensor's is computed in place."""
    return _local(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum"))


def compared_vocab(spec, tokenizer_vocab: Optional[int], teachers) -> int:
    """The vocabulary the divergence compares: the tokenizer's real one, not the rows
    the student or a teacher pads its embedding with."""
    return min(tokenizer_vocab or spec.model_arch.vocab_size, spec.model_arch.vocab_size, *(t.cfg.vocab_size for t in teachers))


class DistillObjective:
    def __init__(self, spec, tokens_per_rank: int, vocab: int, tp_group=None):
        self.settings = spec.distill
        # With sequence parallelism each TP rank holds its part of the sequence's hidden states.
        self.hidden_group = tp_group if spec.parallel.sequence_parallel else None
        self.divergence = Divergence(self.settings.loss, beta=self.settings.beta, skew=self.settings.skew)
        on_policy = self.settings.on_policy
        self.on_policy_divergence = Divergence(on_policy.loss, beta=self.settings.beta, skew=self.settings.skew) if on_policy else None
        self.weights = [source.weight for source in self.settings.sources]
        self.tokens_per_rank, self.vocab, self.tp_group = tokens_per_rank, vocab, tp_group
        self.compiled = spec.parallel.compile  # the loss compiled with the blocks
        # Stored answers without their soft targets leave nothing of the teacher to compare with.
        self.measures_teacher = not (self.settings.instruct is not None and self.settings.top_k is None)

    @property
    def term_names(self) -> list[str]:
        """The terms each micro-batch reports, in `TERMS` order."""
        s = self.settings
        return [name for name, on in zip(TERMS, (s.ce_weight, s.kd_weight, s.hidden is not None)) if on]

    def __call__(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        teacher: list[torch.Tensor] | TopK,
        hidden: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]] = None,
        learnt: Optional[torch.Tensor] = None,
        on_policy: bool = False,
    ) -> tuple[torch.Tensor, dict]:
        """(the weighted loss, {term: its value}) of one micro-batch. `teacher`: one logits
        tensor per online teacher, or the cache's top-k targets; `hidden`: the adapted
        student outputs and the teacher's, pair by pair; `learnt`: a masked step's N / dp
        (`targets` then hold IGNORE_INDEX where nothing is learnt). `on_policy`: the
        tokens learnt are the student's own, so the only term is `distill.on_policy.loss`
        from the teachers (cross-entropy on them would teach the student its own samples)."""
        s = self.settings
        per_rank = self.tokens_per_rank if learnt is None else learnt
        mask = None if learnt is None else learnt_mask(targets)
        if on_policy:
            kd = kd_loss_sum(
                _local(logits),
                self._targets(teacher),
                mask,
                self.on_policy_divergence,
                s.temperature,
                self.vocab,
                self.tp_group,
                s.chunk_tokens,
                compiled=self.compiled,
            )
            return s.kd_weight * kd / per_rank, {"kd_loss": kd / per_rank}
        terms = {}
        if s.ce_weight:
            terms["ce_loss"] = _cross_entropy_sum(logits, targets) / per_rank
        if s.kd_weight:
            kd = kd_loss_sum(
                _local(logits),
                self._targets(teacher),
                mask,
                self.divergence,
                s.temperature,
                self.vocab,
                self.tp_group,
                s.chunk_tokens,
                compiled=self.compiled,
            )
            terms["kd_loss"] = kd / per_rank
        if hidden is not None:
            total = hidden_loss_sum(*hidden, mask, s.hidden.loss)
            if self.hidden_group is not None:
                total = SumOfShares.apply(total, self.hidden_group)
            terms["hidden_loss"] = total / per_rank
        weights = {"ce_loss": s.ce_weight, "kd_loss": s.kd_weight, "hidden_loss": s.hidden_weight}
        total = sum(weights[name] * value for name, value in terms.items())
        return total, terms

    def _teacher(self, teacher_logits: list[torch.Tensor]):
        """One teacher's logits (this rank's vocabulary shard), or the teachers' `Mixture`."""
        local = [_local(t) for t in teacher_logits]
        return local[0] if len(local) == 1 else Mixture(local, self.weights)

    def _targets(self, teacher):
        """The online teachers (their mixture), or with `top_k` their k most likely tokens
        at the temperature; the cache's targets as they are."""
        if isinstance(teacher, TopK):
            return teacher
        teacher = self._teacher(teacher)
        k: Optional[int] = self.settings.top_k
        if k is None:
            return teacher
        return top_k(teacher_log_probs(teacher, self.settings.temperature, self.vocab, self.tp_group), k, self.tp_group)

    def held_out_sums(self, logits: torch.Tensor, targets: torch.Tensor, teacher: list[torch.Tensor] | TopK) -> torch.Tensor:
        """Sums over one held-out micro-batch's learnt tokens (all but IGNORE_INDEX
        targets) of the student's cross-entropy, KL(teacher || student), and top-1
        agreement with the teacher (the teachers' mixture), then the tokens counted.
        Online: the full KL at temperature 1. From the cache: the top-k KL with its
        tail bucket at the cache's temperature (what the cache holds)."""
        ce = _cross_entropy_sum(logits, targets)
        mask = learnt_mask(targets)
        if not self.measures_teacher:
            return torch.stack([ce.detach(), torch.zeros_like(ce), torch.zeros_like(ce), mask.sum().float()])
        student = _local(logits)
        compared = mask
        if isinstance(teacher, TopK):
            kl = (
                kd_loss_sum(
                    student, teacher, mask, Divergence("forward_kl"), self.settings.temperature, self.vocab, self.tp_group, self.settings.chunk_tokens
                )
                / self.settings.temperature**2
            )
            teacher_top1 = teacher.ids[..., 0]  # stored most likely first
            if teacher.aligned is not None:  # no target there (another tokenizer's teacher): no agreement
                compared = mask & teacher.aligned.reshape(mask.shape)
        else:
            teacher = self._teacher(teacher)
            kl = kd_loss_sum(student, teacher, mask, Divergence("forward_kl"), 1.0, self.vocab, self.tp_group, self.settings.chunk_tokens)
            scores = teacher if isinstance(teacher, torch.Tensor) else teacher_log_probs(teacher, 1.0, self.vocab, self.tp_group)
            teacher_top1 = self._top1(scores)
        agree = ((self._top1(student) == teacher_top1) & compared).sum()
        return torch.stack([ce.detach(), kl.detach(), agree.float(), mask.sum().float()])

    def held_out_means(self, sums: torch.Tensor, dp_group=None) -> dict[str, float]:
        """`held_out_sums` added up over a rank's micro-batches, as per-token means over
        the held-out global batch (summed over `dp_group` first)."""
        if dp_group is not None:
            dist.all_reduce(sums, group=dp_group)
        means = dict(zip(EVAL_METRICS, (sums[:-1] / sums[-1].clamp(min=1)).tolist()))
        return means if self.measures_teacher else {"eval_loss": means["eval_loss"]}

    def _top1(self, logits: torch.Tensor) -> torch.Tensor:
        """The most likely token's id; under TP the smallest such id over all shards
        (torch.argmax's choice among ties)."""
        logits = within_vocab(logits, self.vocab, self.tp_group)
        if self.tp_group is None:
            return logits.argmax(dim=-1)
        best, index = logits.max(dim=-1)
        index = index + dist.get_rank(self.tp_group) * logits.shape[-1]
        top = best.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.tp_group)
        index = torch.where(best == top, index, torch.iinfo(index.dtype).max)
        dist.all_reduce(index, op=dist.ReduceOp.MIN, group=self.tp_group)
        return index
