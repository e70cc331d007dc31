"""Which next tokens a step learns: every one, or those an instruction dataset's loss
mask marks (the answers'), the others given cross-entropy's ignore index; and the
count N of learnt tokens over the whole global batch, by which every loss term is
divided (each rank divides by N / dp, since data parallelism averages gradients).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

IGNORE_INDEX = -100  # F.cross_entropy's default: such a target adds nothing, and counts for nothing


def next_token_labels(micro_batches: torch.Tensor, loss_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Each position's next token [..., seq_len], IGNORE_INDEX where the mask is 0."""
    targets = micro_batches[..., 1:]
    return targets if loss_mask is None else targets.masked_fill(loss_mask.to(targets.device) == 0, IGNORE_INDEX)


def learnt_per_rank(labels: torch.Tensor, dp_group, dp: int) -> torch.Tensor:
    """N / dp for a step (or a held-out batch) whose labels carry IGNORE_INDEX: one
    all-reduce of this rank's count. Never 0: a batch that learns nothing has loss 0."""
    count = (labels != IGNORE_INDEX).sum().float()
    if dp > 1:
        dist.all_reduce(count, group=dp_group)
    return count.clamp(min=1) / dp


def learnt_mask(labels: torch.Tensor) -> torch.Tensor:
    return labels != IGNORE_INDEX
