"""The held-out split that `eval` measures: how many of its global batches one
evaluation takes, what a job may ask of it, and each rank's share of those batches.

The split's samples are read in id order, batch b being samples b*G .. (b+1)*G-1
for global batch G, split over DP ranks and micro-batches as a training step is:
every layout evaluates the same samples, so the loss is the same number on each.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from lmforge.data import storage
from lmforge.data.columns import TargetScorer, TopKTargets, sample_columns, scored_columns, target_columns
from lmforge.data.manifest import DatasetManifest, HeldOutSplit
from lmforge.data.order import BatchLayout
from lmforge.errors import UserError


def eval_batches(spec, manifest: DatasetManifest) -> int:
    """Global batches per evaluation: `eval.batches`, or all whole ones the split holds."""
    held, batch = manifest.eval_samples, spec.train.global_batch
    return spec.eval.batches or held // batch


def check_held_out(spec, manifest: DatasetManifest, path: str) -> None:
    """Refuse an evaluation the dataset at `path` cannot serve, or a held-out split
    asked for that it was not prepared with (it would be silently missing)."""
    held = manifest.eval
    asked = spec.eval.source if spec.eval else None
    if spec.data.eval_fraction and (held.fraction if held else None) != spec.data.eval_fraction:
        raise UserError(
            f"data.eval_fraction: {spec.data.eval_fraction}, but {path} was prepared with {_made_with(held)}; "
            "prepare it again (remove it, or choose another data.path)"
        )
    if asked and (held.source if held else None) != asked:
        raise UserError(
            f"eval.source: {asked}, but {path} was prepared with {_made_with(held)}; prepare it again (remove it, or choose another data.path)"
        )
    if spec.eval is None:
        return
    if held is None:
        raise UserError(f"eval: {path} holds no held-out split; prepare it with data.eval_fraction or eval.source")
    size = spec.train.global_batch
    if held.num_samples < size:
        raise UserError(
            f"eval: the held-out split of {path} holds {held.num_samples} samples, fewer than one global batch "
            f"(train.global_batch {size}); hold out more (data.eval_fraction, eval.source)"
        )
    if spec.eval.batches and spec.eval.batches * size > held.num_samples:
        raise UserError(
            f"eval.batches: {spec.eval.batches} batches of {size} samples need {spec.eval.batches * size} held-out samples; "
            f"{path} holds {held.num_samples} (at most {held.num_samples // size} batches)"
        )


def _made_with(held: Optional[HeldOutSplit]) -> str:
    if held is None:
        return "no held-out split"
    return f"data.eval_fraction {held.fraction}" if held.fraction else f"eval.source {held.source}"


class HeldOutBatches:
    """One rank's micro-batches of each held-out global batch: read at the first
    evaluation and kept (this rank's share of a few batches), not read again at every
    one. With top-k targets (a teacher cache's, or the dataset's own), each sample's
    targets too."""

    def __init__(
        self,
        data_path: str,
        manifest: DatasetManifest,
        layout: BatchLayout,
        dp_rank: int,
        batches: int,
        cache: Optional[TopKTargets] = None,
        scorer: Optional[TargetScorer] = None,
    ):
        """`scorer`: the targets made for this rank's held-out rows when they are read (a served teacher)."""
        held = manifest.eval
        if held is None:
            raise ValueError(f"{data_path} holds no held-out split")  # refused before launch (check_held_out)
        self.directory = storage.join(data_path, held.dir)
        self.shards = held.shards
        self.shard_samples, self.seq_len, self.manifest = manifest.shard_samples, manifest.seq_len, manifest
        self.layout, self.dp_rank, self.batches, self.cache, self.scorer = layout, dp_rank, batches, cache, scorer
        self._read: list[tuple] | None = None

    def __iter__(self):
        """(tokens [accum, micro, seq_len+1], top-k ids and log-probs [accum, micro, seq_len, k] or
        None, the loss mask [accum, micro, seq_len] or None) for each global batch in turn."""
        if self._read is None:
            self._read = list(self._read_batches())
        return iter(self._read)

    def _read_batches(self):
        # The batches are the split's first samples: read those shards, keep this rank's rows.
        files = [shard.file for shard in self.shards[: -(-self.batches * self.layout.global_batch // self.shard_samples)]]
        targets = self.cache.eval_directory if self.cache else None
        if self.cache is not None and targets is None:
            raise ValueError(f"{self.cache.directory} holds no held-out targets")  # refused before launch (read_cache)
        own = targets is not None and storage.join(targets) == self.directory  # an instruction dataset's own top-k
        k = self.cache.k if self.cache else None
        columns = {name: _rows(self.directory, files, name, shape) for name, shape in sample_columns(self.manifest, k if own else None).items()}
        if targets is not None and k and not own:
            columns |= {name: _rows(targets, files, name, shape) for name, shape in target_columns(self.seq_len, k).items()}
        shape = (self.layout.accum, self.layout.micro_batch)
        for batch in range(self.batches):
            first, count = self.layout.rank_positions(batch, self.dp_rank)
            taken = {name: c[first : first + count].reshape(*shape, *c.shape[1:]).copy() for name, c in columns.items()}
            if self.scorer is not None:
                scored = scored_columns(self.scorer, taken["tokens"].reshape(count, -1))
                taken |= {name: values.reshape(*shape, *values.shape[1:]) for name, values in scored.items()}
            targets = (taken["topk_ids"], taken["topk_logprobs"]) if "topk_ids" in taken else None
            yield taken["tokens"], targets, taken.get("loss_mask")


def _rows(directory: str, files: list[str], column: str, row_shape: tuple) -> np.ndarray:
    table = storage.read_parquet([storage.join(directory, f) for f in files], [column])
    return table.column(column).combine_chunks().flatten().to_numpy().reshape(-1, *row_shape)
