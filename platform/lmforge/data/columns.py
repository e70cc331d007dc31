"""What a dataset's shards hold per sample, column by column: every dataset its
tokens; an instruction dataset its loss mask (and its teachers' top-k soft targets);
a teacher cache its top-k targets."""

from __future__ import annotations

from typing import Optional


def sample_columns(manifest: dict, k: Optional[int] = None) -> dict[str, tuple]:
    """The columns a feed reads of a dataset's shards, by the shape of one sample's value:
    its tokens [seq_len+1]; an instruction dataset's loss mask [seq_len]; with `k`, top-k
    ids and log-probabilities [seq_len, k] (a teacher cache's, or an instruction
    dataset's own)."""
    seq_len = manifest["seq_len"]
    columns = {"tokens": (seq_len + 1,)}
    if is_masked(manifest):
        columns["loss_mask"] = (seq_len,)
    return columns | (target_columns(seq_len, k) if k else {})


def target_columns(seq_len: int, k: int) -> dict[str, tuple]:
    return {"topk_ids": (seq_len, k), "topk_logprobs": (seq_len, k)}


def is_masked(manifest: dict) -> bool:
    """Whether a dataset's samples learn only some tokens (an instruction dataset's answers)."""
    return "instruct" in manifest
