"""Kept answers as SFT samples of an lmforge dataset: one answer per row (its prompt,
then the answer, padded with the end-of-text token), a loss mask over the answer's
tokens only, and the teacher's top-k soft targets at those positions. One answer per
row means no answer ever attends to another's prompt, on every layout. Each sample
also says which prompt, teacher and answer index it came from.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from lmforge.data.packing import ShardWriter
from lmforge.distill_jobs.instruct.selection import mean_logprobs

ORIGIN = ("prompt_index", "teacher", "sample")  # where each sample's answer came from, beside its mean log-probability


def _lists(answers: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A list column's flat values and each row's offsets into them."""
    column = answers.column(name).combine_chunks()
    return column.values.to_numpy(zero_copy_only=False), column.offsets.to_numpy()


def write_samples(writer: ShardWriter, answers: pa.Table, rows: list[int], seq_len: int, pad_id: int, k: int | None) -> int:
    """Append the answers `rows` as samples; returns the answer tokens they hold (the
    targets the loss counts). Row i's target at position t is token t+1, so the answer
    is learnt at positions len(prompt) - 1 onwards; there the soft targets of each
    answer token are the teacher's top k at the position that predicted it."""
    prompts, prompt_at = _lists(answers, "prompt_ids")
    replies, reply_at = _lists(answers, "answer_ids")
    if k:
        top_ids, _ = _lists(answers, "topk_ids")
        top_logprobs, _ = _lists(answers, "topk_logprobs")
    width = seq_len + 1
    tokens = np.full((len(rows), width), pad_id, dtype=np.int32)
    mask = np.zeros((len(rows), seq_len), dtype=np.uint8)
    targets = (
        {"topk_ids": np.zeros((len(rows), seq_len, k), dtype=np.int32), "topk_logprobs": np.zeros((len(rows), seq_len, k), dtype=np.float16)}
        if k
        else {}
    )
    learnt = 0
    for out, row in enumerate(rows):
        prompt = prompts[prompt_at[row] : prompt_at[row + 1]]
        begin, end = reply_at[row], reply_at[row + 1]
        first, count = len(prompt) - 1, int(end - begin)
        tokens[out, : len(prompt)] = prompt
        tokens[out, len(prompt) : len(prompt) + count] = replies[begin:end]
        mask[out, first : first + count] = 1
        if k:
            targets["topk_ids"][out, first : first + count] = top_ids[begin * k : end * k].reshape(count, k)
            targets["topk_logprobs"][out, first : first + count] = top_logprobs[begin * k : end * k].reshape(count, k)
        learnt += count
    origin = {name: answers.column(name).to_numpy()[rows] for name in ORIGIN}
    writer.add(
        tokens,
        loss_mask=mask,
        **{name: values.reshape(len(rows), -1) for name, values in targets.items()},
        **origin,
        mean_logprob=mean_logprobs(answers)[rows].astype(np.float32),
    )
    return learnt
