"""On-policy distillation (GKD): on a share of the steps the student continues each
row's prompt with tokens it samples itself, and learns the online teachers'
distributions on those tokens rather than on the data's.

Which steps, and each row's tokens, are functions of the seed, the step and the
sample id alone: every layout, and a run resumed from a checkpoint, writes the same
continuations. The student generates with plain forwards over the whole row (no KV
cache), so FSDP and tensor parallelism need nothing of their own; every rank runs
the same number of forwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lmforge.inference.sampling import SamplingParams, next_tokens

STEP_STREAM = 0x0F  # keeps the choice of steps apart from the rows' sampling seeds


@dataclass
class Rollout:
    """One on-policy step's work on a rank: a sampling seed per row of its micro-batches."""

    row_seeds: np.ndarray  # one per row of the rank's micro-batches, in their order
    max_new_tokens: int
    temperature: float
    eos: int

    @torch.no_grad()
    def continue_prompts(self, forward: Callable[[torch.Tensor], torch.Tensor], micro_batches: torch.Tensor,
                         loss_mask: Optional[torch.Tensor], vocab: int, tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(each row's prompt followed by the student's tokens and end-of-text padding,
        the loss mask of the positions whose next token the student wrote). A row's
        prompt is its tokens up to the loss mask's first learnt position (an instruction
        dataset's prompt), else all but the last `max_new_tokens`."""
        seq_len = micro_batches.shape[-1] - 1
        if loss_mask is None:
            prompt_lengths = torch.full(micro_batches.shape[:2], seq_len + 1 - self.max_new_tokens, dtype=torch.long)
        else:
            learnt = loss_mask.bool()
            # The first learnt position is the prompt's last token; a row learning nothing has no room.
            prompt_lengths = torch.where(learnt.any(-1), learnt.long().argmax(-1) + 1, seq_len + 1)
        seeds = self.row_seeds.reshape(micro_batches.shape[:2])
        rows, masks = zip(*(self._continue(forward, batch, prompt_lengths[i].to(batch.device), seeds[i], vocab, tp_group)
                            for i, batch in enumerate(micro_batches)))
        return torch.stack(rows), torch.stack(masks)

    def _continue(self, forward, tokens: torch.Tensor, prompt_lengths: torch.Tensor, seeds, vocab: int, tp_group) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, total = tokens.clone(), tokens.shape[-1]
        params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature)
        generators = [torch.Generator(tokens.device).manual_seed(int(seed)) for seed in seeds]
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        length = prompt_lengths.clone()  # where each row's next token goes
        end = (prompt_lengths + self.max_new_tokens).clamp(max=total)
        running = length < end
        for _ in range(self.max_new_tokens):
            if not _anyone(running):
                break
            logits = _gathered(forward(tokens[:, :-1]), rows, (length - 1).clamp(max=total - 2), tp_group)[:, :vocab].float()
            chosen = self._sample(logits, generators, running)
            writing = running.nonzero().flatten()
            tokens[writing, length[writing]] = chosen[writing]
            finished = running & (chosen == self.eos)
            length = length + running.long()
            running = running & ~finished & (length < end)
        positions = torch.arange(total, device=tokens.device)
        tokens = torch.where(positions >= length[:, None], self.eos, tokens)
        targets = positions[:-1]  # position j learns token j + 1
        mask = (targets >= prompt_lengths[:, None] - 1) & (targets < length[:, None] - 1)
        return tokens, mask

    def _sample(self, logits: torch.Tensor, generators: list[torch.Generator], running: torch.Tensor) -> torch.Tensor:
        """The next token of each running row, each from its own generator (the
        inference module's rule), so that a row's tokens do not depend on its batch."""
        params = SamplingParams(temperature=self.temperature)
        if params.greedy:
            return logits.argmax(dim=-1)
        chosen = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        for row in running.nonzero().flatten().tolist():
            chosen[row] = next_tokens(logits[row:row + 1], params, None, generators[row])[0]
        return chosen


def _gathered(logits: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, tp_group) -> torch.Tensor:
    """Each row's logits at its position [rows, vocab]: under tensor parallelism this
    rank holds a vocabulary shard, and the shards are gathered for those positions only."""
    local = logits.to_local() if isinstance(logits, DTensor) else logits
    picked = local[rows, positions]
    if tp_group is None:
        return picked
    shards = [torch.empty_like(picked) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(shards, picked.contiguous(), group=tp_group)
    return torch.cat(shards, dim=-1)


def _anyone(running: torch.Tensor) -> bool:
    """Whether any rank still has a row to continue: all ranks run the same forwards
    (FSDP gathers and TP's collectives take every rank)."""
    flag = running.any().to(torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class OnPolicy:
    """A job's `distill.on_policy`: which steps are on-policy, and their rollouts."""

    def __init__(self, spec, eos: int):
        self.settings, self.seed, self.eos = spec.distill.on_policy, spec.train.seed, eos

    def chooses(self, step: int) -> bool:
        """The same answer on every rank, on any layout and after any restart."""
        return bool(np.random.default_rng([self.seed, step, STEP_STREAM]).random() < self.settings.fraction)

    def for_step(self, step: int, sample_ids: np.ndarray) -> Optional[Rollout]:
        """The step's rollout over this rank's rows (`sample_ids` in their order), None
        for an off-policy step."""
        if not self.chooses(step):
            return None
        seeds = np.array([row_seed(self.seed, step, int(i)) for i in np.asarray(sample_ids).ravel()], dtype=np.int64)
        s = self.settings
        return Rollout(seeds, s.max_new_tokens, s.temperature, self.eos)


def row_seed(seed: int, step: int, sample_id: int) -> int:
    return int(np.random.SeedSequence([seed, step, sample_id]).generate_state(1)[0])
