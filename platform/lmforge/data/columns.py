"""What a dataset's shards hold per sample, column by column: every dataset its
tokens; an instruction dataset its loss mask (and its teachers' top-k soft targets);
a teacher cache its top-k targets."""

from __future__ import annotations

from typing import Optional, Protocol

import numpy as np
from pydantic import BaseModel

from lmforge.data.manifest import DatasetManifest


class TopKTargets(BaseModel):
    """Where a job's top-k soft targets lie: shards named as the dataset's, in
    `directory` (the dataset's own when its samples carry them), and the held-out
    split's in `eval_directory`."""

    directory: str
    k: int
    eval_directory: Optional[str] = None


class TargetScorer(Protocol):
    """Top-k targets made as the rows are read (a teacher behind a server), in the shape
    a teacher cache stores them: the feed asks it for each chunk's rows at once."""

    k: int

    def score(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[rows, seq_len + 1] tokens -> top-k ids and log-probabilities [rows, seq_len, k]."""
        ...


def scored_columns(scorer: TargetScorer, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """The target columns of rows of tokens, named as a cache's."""
    ids, logprobs = scorer.score(tokens)
    return {"topk_ids": ids, "topk_logprobs": logprobs}


def sample_columns(manifest: DatasetManifest, k: Optional[int] = None) -> dict[str, tuple]:
    """The columns a feed reads of a dataset's shards, by the shape of one sample's value:
    its tokens [seq_len+1]; an instruction dataset's loss mask [seq_len]; with `k`, top-k
    ids and log-probabilities [seq_len, k] (a teacher cache's, or an instruction
    dataset's own)."""
    seq_len = manifest.seq_len
    columns = {"tokens": (seq_len + 1,)}
    if manifest.masked:
        columns["loss_mask"] = (seq_len,)
    return columns | (target_columns(seq_len, k) if k else {})


def target_columns(seq_len: int, k: int) -> dict[str, tuple]:
    return {"topk_ids": (seq_len, k), "topk_logprobs": (seq_len, k)}
