"""Token-weighted negative log-likelihood of a model on a prepared dataset's held-out
split (its answers only, for an instruction dataset): what `lmforge quantize`
compares a quantized model against its source with."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from lmforge.data.manifest import has_manifest, read_manifest
from lmforge.errors import UserError


def held_out_samples(dataset: str | Path, limit: int, name: str = "--eval-data") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first `limit` held-out samples: tokens [n, seq_len+1] and the loss mask [n, seq_len] or None."""
    dataset = Path(dataset)
    if not has_manifest(dataset, name):
        raise UserError(f"{name}: {dataset} is not a prepared dataset (no manifest.json)")
    manifest = read_manifest(dataset, name)
    held = manifest.eval
    if held is None:
        raise UserError(f"{name}: {dataset} has no held-out split; prepare it with --eval-fraction or --eval-source")
    columns = ["tokens"] + (["loss_mask"] if manifest.masked else [])
    files = [str(dataset / held.dir / shard.file) for shard in held.shards]
    table = pq.read_table(files, columns=columns).slice(0, limit)
    tokens = torch.tensor(table.column("tokens").to_pylist())
    mask = torch.tensor(table.column("loss_mask").to_pylist(), dtype=torch.bool) if "loss_mask" in columns else None
    return tokens, mask


@torch.no_grad()
def mean_nll(model, tokens: torch.Tensor, mask: torch.Tensor | None, vocab: int, batch: int = 16) -> float:
    """Summed over every scored token of every sample, divided by their count."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for first in range(0, len(tokens), batch):
        rows = tokens[first : first + batch].to(device)
        logits = model(rows[:, :-1])[..., :vocab].float()
        losses = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="none")
        keep = mask[first : first + batch].to(device).flatten() if mask is not None else torch.ones_like(losses, dtype=torch.bool)
        total += float(losses[keep].sum())
        count += int(keep.sum())
    if count == 0:
        raise UserError("--eval-data: the held-out samples score no tokens")
    return total / count


def perplexity(nll: float) -> float:
    return math.exp(nll)
