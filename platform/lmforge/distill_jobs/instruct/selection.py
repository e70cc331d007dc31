"""Which answers the student learns: the ones its teachers did well on. Each rule
drops what fails it, in `RULES` order, and counts it under the first rule it failed.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

RULES = ("truncated", "too_short", "too_long", "low_logprob", "duplicate", "not_best")


def mean_logprobs(answers: pa.Table) -> np.ndarray:
    """Each answer's mean token log-probability under its own teacher."""
    column = answers.column("logprobs").combine_chunks()
    offsets = column.offsets.to_numpy()
    sums = np.add.reduceat(column.values.to_numpy().astype(np.float64), offsets[:-1]) if len(column.values) else np.zeros(len(column))
    lengths = np.diff(offsets)
    return np.where(lengths > 0, sums / np.maximum(lengths, 1), -np.inf)


def select(answers: pa.Table, rules, teachers: int) -> tuple[list[int], dict[str, int]]:
    """(the rows kept, in answer order; {rule: answers it dropped}) under
    `distill.instruct.select`."""
    dropped = dict.fromkeys(RULES, 0)
    lengths = [len(ids) for ids in answers.column("answer_ids").to_pylist()]
    finish = answers.column("finish_reason").to_pylist()
    means = mean_logprobs(answers)
    checks = {
        "truncated": lambda i: rules.drop_truncated and finish[i] == "length",
        "too_short": lambda i: lengths[i] < rules.min_tokens,
        "too_long": lambda i: rules.max_tokens is not None and lengths[i] > rules.max_tokens,
        "low_logprob": lambda i: rules.min_mean_logprob is not None and means[i] < rules.min_mean_logprob,
    }
    kept = []
    for row in range(answers.num_rows):
        failed = next((rule for rule, fails in checks.items() if fails(row)), None)
        if failed:
            dropped[failed] += 1
        else:
            kept.append(row)
    if rules.dedupe:
        kept = _first_of_each(answers, kept, dropped)
    if rules.teachers == "best" and teachers > 1:
        kept = _best_of_teachers(answers, kept, means, dropped)
    return kept, dropped


def _first_of_each(answers: pa.Table, rows: list[int], dropped: dict) -> list[int]:
    """An answer identical to one already kept for the same prompt text is dropped."""
    prompts, replies = answers.column("prompt_ids").to_pylist(), answers.column("answer_ids").to_pylist()
    seen, kept = set(), []
    for row in rows:
        key = (tuple(prompts[row]), tuple(replies[row]))
        if key in seen:
            dropped["duplicate"] += 1
        else:
            seen.add(key)
            kept.append(row)
    return kept


def _best_of_teachers(answers: pa.Table, rows: list[int], means: np.ndarray, dropped: dict) -> list[int]:
    """Per prompt and answer index, the teachers' answer with the best mean log-probability
    (the first teacher's on a tie)."""
    prompt, sample, teacher = (answers.column(name).to_pylist() for name in ("prompt_index", "sample", "teacher"))
    best: dict[tuple[int, int], int] = {}
    for row in rows:
        key = (prompt[row], sample[row])
        held = best.get(key)
        if held is None or (means[row], -teacher[row]) > (means[held], -teacher[held]):
            best[key] = row
    winners = set(best.values())
    dropped["not_best"] += len(rows) - len(winners)
    return [row for row in rows if row in winners]
