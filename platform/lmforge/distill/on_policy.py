"""On-policy distillation (GKD): on a share of the steps the student continues each
row's prompt with tokens it samples itself, and learns the online teachers'
distributions on those tokens rather than on the data's.

Which steps, and each row's tokens, are functions of the seed, the step and the
sample id alone: every layout, and a run resumed from a checkpoint, writes the same
continuations. The student generates with the inference module (a KV cache), or under
tensor parallelism with whole-row forwards; every rank runs the same number of
forwards (the engine decides how its weights are gathered meanwhile).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lmforge.inference.generate import generate_ids
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
    def continue_prompts(
        self, model, micro_batches: torch.Tensor, loss_mask: Optional[torch.Tensor], vocab: int, tp_group=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(each row's prompt followed by the student's tokens and end-of-text padding,
        the loss mask of the positions whose next token the student wrote). A row's
        prompt is its tokens up to the loss mask's first learnt position (an instruction
        dataset's prompt), else all but the last `max_new_tokens`. Without tensor
        parallelism the inference module generates (a KV cache); with it (a rank holds
        a share of the heads and of the vocabulary) each token is a whole-row forward."""
        seq_len = micro_batches.shape[-1] - 1
        if loss_mask is None:
            prompt_lengths = torch.full(micro_batches.shape[:2], seq_len + 1 - self.max_new_tokens, dtype=torch.long)
        else:
            learnt = loss_mask.bool()
            # The first learnt position is the prompt's last token; a row learning nothing has no room.
            prompt_lengths = torch.where(learnt.any(-1), learnt.long().argmax(-1) + 1, seq_len + 1)
        # The same choice on every rank: the longest row and its tokens must fit the rotary tables.
        cached = tp_group is None and seq_len + 1 + self.max_new_tokens <= model.cfg.max_seq_len
        seeds = self.row_seeds.reshape(micro_batches.shape[:2])
        rows, masks = [], []
        for batch, lengths, batch_seeds in zip(micro_batches, prompt_lengths.tolist(), seeds):
            rooms = [min(self.max_new_tokens, seq_len + 1 - length) for length in lengths]
            written = (
                self._generate(model, batch, lengths, rooms, batch_seeds, vocab)
                if cached
                else self._recompute(model, batch, lengths, rooms, batch_seeds, vocab, tp_group)
            )
            row, mask = self._laid_out(batch, lengths, written)
            rows.append(row)
            masks.append(mask)
        return torch.stack(rows), torch.stack(masks)

    def _params(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature)

    def _generate(self, model, tokens: torch.Tensor, lengths: list[int], rooms: list[int], seeds, vocab: int) -> list[list[int]]:
        """Each row's new tokens (at most its room), from the inference module."""
        rows = [row for row, room in enumerate(rooms) if room > 0]
        # A rank with no row to continue still runs the forwards its peers run.
        prompts = [tokens[row, : lengths[row]].tolist() for row in rows] or [[self.eos]]
        results = generate_ids(
            model,
            prompts,
            self._params(),
            frozenset({self.eos}),
            vocab,
            row_seeds=[int(seeds[row]) for row in rows] or [0],
            go_on=lambda running: _anyone(running, tokens.device),
        )
        written = [[] for _ in lengths]
        for row, result in zip(rows, results):
            written[row] = result.tokens[: rooms[row]]
        return written

    def _recompute(self, model, tokens: torch.Tensor, lengths: list[int], rooms: list[int], seeds, vocab: int, tp_group) -> list[list[int]]:
        """Each row's new tokens, each from a forward over the whole (fixed-length) row:
        a token's logits depend on the tokens before it alone."""
        tokens, params = tokens.clone(), self._params()
        generators = [torch.Generator(tokens.device).manual_seed(int(seed)) for seed in seeds]
        written: list[list[int]] = [[] for _ in lengths]
        running = [room > 0 for room in rooms]
        for _ in range(self.max_new_tokens):
            if not _anyone(any(running), tokens.device):
                break
            at = torch.tensor([length + len(new) - 1 for length, new in zip(lengths, written)], device=tokens.device)
            logits = _gathered(model(tokens[:, :-1]), at.clamp(max=tokens.shape[-1] - 2), tp_group)[:, :vocab].float()
            for row in (r for r, on in enumerate(running) if on):
                token = int(next_tokens(logits[row : row + 1], params, None, generators[row])[0])
                tokens[row, lengths[row] + len(written[row])] = token
                written[row].append(token)
                running[row] = token != self.eos and len(written[row]) < rooms[row]
        return written

    def _laid_out(self, tokens: torch.Tensor, lengths: list[int], written: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows with their new tokens after the prompts, end-of-text after those, and
        the mask of the positions whose next token is new."""
        tokens = tokens.clone()
        targets = torch.arange(tokens.shape[-1] - 1, device=tokens.device)  # position j learns token j + 1
        mask = torch.zeros(tokens.shape[0], tokens.shape[-1] - 1, dtype=torch.bool, device=tokens.device)
        for row, (length, new) in enumerate(zip(lengths, written)):
            end = length + len(new)
            tokens[row, length:end] = torch.tensor(new, dtype=tokens.dtype)
            tokens[row, end:] = self.eos
            mask[row] = (targets >= length - 1) & (targets < end - 1)
        return tokens, mask


def _gathered(logits: torch.Tensor, positions: torch.Tensor, tp_group) -> torch.Tensor:
    """Each row's logits at its position [rows, vocab]: under tensor parallelism this
    rank holds a vocabulary shard, and the shards are gathered for those positions only."""
    local = logits.to_local() if isinstance(logits, DTensor) else logits
    picked = local[torch.arange(local.shape[0], device=local.device), positions]
    if tp_group is None:
        return picked
    shards = [torch.empty_like(picked) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(shards, picked.contiguous(), group=tp_group)
    return torch.cat(shards, dim=-1)


def _anyone(running: bool, device: torch.device) -> bool:
    """Whether any rank still has a row to continue: all ranks run the same forwards
    (FSDP gathers and TP's collectives take every rank). On `device`: NCCL reduces
    GPU tensors only."""
    flag = torch.tensor(int(running), device=device)
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
