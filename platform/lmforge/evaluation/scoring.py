"""How lm-eval's `hf` backend scores a continuation, on logits wherever they are: one
right-padded batch of inputs, and for each row the log-probability of its continuation
and whether greedy decoding would have produced it. Torch only (no lm-eval here)."""

from __future__ import annotations

import torch

# (the continuation's summed log-probability, whether every token was the most likely)
ContinuationScore = tuple[float, bool]


def right_padded(inputs: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """One row per input, zeros after it: causal attention, so padding after a row
    changes nothing in it."""
    tokens = torch.zeros(len(inputs), max(map(len, inputs)), dtype=torch.long, device=device)
    for row, ids in enumerate(inputs):
        tokens[row, : len(ids)] = torch.tensor(ids)
    return tokens


def continuation_scores(logits: torch.Tensor, inputs: list[list[int]], continuations: list[list[int]]) -> list[ContinuationScore]:
    """Each row's continuation is the last tokens its input predicts (the input is the
    context and the continuation less its last token)."""
    logprobs = logits.float().log_softmax(dim=-1)
    scores = []
    for row, (ids, continuation) in enumerate(zip(inputs, continuations)):
        wanted = torch.tensor(continuation, device=logprobs.device)
        at = logprobs[row, len(ids) - len(continuation) : len(ids)]
        scores.append((float(at.gather(1, wanted[:, None]).sum()), bool((at.argmax(dim=-1) == wanted).all())))
    return scores
