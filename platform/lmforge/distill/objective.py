"""A distillation job's loss for one micro-batch: the weighted sum of the
cross-entropy on the data and the divergence from the teacher, each term divided
by the tokens a rank trains on per step (FSDP then averages over ranks, so every
term is its sum over the global batch divided by N).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from lmforge.distill.losses import Divergence, TopK, kd_loss_sum

TERMS = ("ce_loss", "kd_loss")


def _local(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's own part: a vocabulary shard of the logits (the KD loss reduces over
    the TP group itself), or the replicated cross-entropy."""
    return value.to_local() if isinstance(value, DTensor) else value


class DistillObjective:
    def __init__(self, spec, tokens_per_rank: int, vocab: int, tp_group=None):
        self.settings = spec.distill
        self.divergence = Divergence(self.settings.loss, beta=self.settings.beta, skew=self.settings.skew)
        self.tokens_per_rank, self.vocab, self.tp_group = tokens_per_rank, vocab, tp_group

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, teacher_logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(the weighted loss, {term: its value}) of one micro-batch."""
        s = self.settings
        terms = {}
        if s.ce_weight:
            # Under loss_parallel a sharded DTensor's cross-entropy is computed in place.
            ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
            terms["ce_loss"] = _local(ce) / self.tokens_per_rank
        if s.kd_weight:
            teacher = self._targets(_local(teacher_logits))
            kd = kd_loss_sum(_local(logits), teacher, None, self.divergence, s.temperature, self.vocab, self.tp_group, s.chunk_tokens)
            terms["kd_loss"] = kd / self.tokens_per_rank
        weights = {"ce_loss": s.ce_weight, "kd_loss": s.kd_weight}
        total = sum(weights[name] * value for name, value in terms.items())
        return total, terms

    def _targets(self, teacher_logits: torch.Tensor):
        """Dense logits, or with `top_k` the teacher's k most likely tokens at the temperature."""
        k: Optional[int] = self.settings.top_k
        if k is None:
            return teacher_logits
        logprobs = (teacher_logits[..., :self.vocab].float() / self.settings.temperature).log_softmax(dim=-1)
        values, ids = logprobs.topk(k, dim=-1)
        return TopK(ids, values)
