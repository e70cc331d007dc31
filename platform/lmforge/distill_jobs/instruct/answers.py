"""The teachers writing answers: a Ray Data actor that takes one unit of prompts at a
time, generates each prompt's answers with every teacher (batched, KV cache), keeps
per new token its log-probability and the teacher's top-k soft targets, and writes
the unit's answers to one Parquet file, atomically, so a rerun keeps it.

An answer depends only on its prompt, its index, its teacher and the seed (each row
samples from its own generator), and a unit's batches are the same on every run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lmforge.distill.teacher import load_whole
from lmforge.inference.generate import generate_ids
from lmforge.inference.sampling import SamplingParams
from lmforge.ray_runtime import tune_process

ANSWER_COLUMNS = (
    "prompt_index",
    "teacher",
    "sample",
    "held_out",
    "prompt_ids",
    "answer_ids",
    "logprobs",
    "finish_reason",
    "topk_ids",
    "topk_logprobs",
)


def unit_file(directory: Path, unit: int) -> Path:
    return directory / f"unit-{unit:05d}.parquet"


def row_seed(seed: int, prompt_index: int, sample: int, teacher: int) -> int:
    """The seed of one answer's sampling: the same whatever batch or actor it lands in."""
    return int(np.random.SeedSequence([seed, prompt_index, sample, teacher]).generate_state(1)[0])


class TeacherAnswers:
    """A Ray Data actor: the teachers on this actor's device; each call answers whole
    units (a batch of `{"unit", "prompts"}` rows, `prompts` a JSON list of [index,
    held_out, token ids]) and returns how many answers and tokens each unit got."""

    def __init__(
        self, paths: list[str], settings: dict, eos_id: int, vocab: int, soft_targets: Optional[tuple[int, float]], out_dir: str, threads: int
    ):
        import torch

        tune_process(threads)
        self.teachers = load_whole(paths, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        self.settings, self.eos_ids, self.vocab = settings, frozenset({eos_id}), vocab
        self.soft_targets, self.out_dir = soft_targets, Path(out_dir)

    def __call__(self, batch: dict) -> dict:
        answers, tokens = [], []
        for unit, prompts in zip(batch["unit"], batch["prompts"]):
            rows = self._answer(json.loads(prompts))
            _write_atomically(unit_file(self.out_dir, int(unit)), rows)
            answers.append(len(rows["prompt_index"]))
            tokens.append(int(sum(len(ids) for ids in rows["answer_ids"])))
        return {"unit": batch["unit"], "answers": np.asarray(answers), "tokens": np.asarray(tokens)}

    def _answer(self, prompts: list) -> dict:

        s = self.settings
        params = SamplingParams(max_new_tokens=s["max_new_tokens"], temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"])
        wanted = [(index, held, ids, sample) for index, held, ids in prompts for sample in range(s["n"])]
        rows: dict[str, list] = {name: [] for name in ANSWER_COLUMNS}
        for teacher_index, teacher in enumerate(self.teachers):
            for start in range(0, len(wanted), s["batch_size"]):
                chunk = wanted[start : start + s["batch_size"]]
                seeds = [row_seed(s["seed"], index, sample, teacher_index) for index, _, _, sample in chunk]
                results = generate_ids(
                    teacher, [ids for _, _, ids, _ in chunk], params, self.eos_ids, self.vocab, row_seeds=seeds, soft_targets=self.soft_targets
                )
                for (index, held, ids, sample), result in zip(chunk, results):
                    _append(rows, index, teacher_index, sample, held, ids, result)
        return rows


def _append(rows: dict, index: int, teacher: int, sample: int, held: bool, prompt_ids: list[int], result) -> None:
    values = (
        index,
        teacher,
        sample,
        held,
        prompt_ids,
        result.tokens,
        result.logprobs,
        result.finish_reason,
        [] if result.top_ids is None else result.top_ids.flatten().tolist(),
        [] if result.top_logprobs is None else result.top_logprobs.flatten().tolist(),
    )
    for name, value in zip(ANSWER_COLUMNS, values):
        rows[name].append(value)


ANSWER_SCHEMA = pa.schema(
    [
        ("prompt_index", pa.int64()),
        ("teacher", pa.int16()),
        ("sample", pa.int16()),
        ("held_out", pa.bool_()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("answer_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("finish_reason", pa.string()),
        ("topk_ids", pa.list_(pa.int32())),
        ("topk_logprobs", pa.list_(pa.float16())),
    ]
)


def _write_atomically(path: Path, rows: dict) -> None:
    """The unit's file appears whole or not at all: written beside it, then renamed."""
    rows = dict(rows, topk_logprobs=[np.asarray(v, dtype=np.float16) for v in rows["topk_logprobs"]])
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    pq.write_table(pa.table(rows, schema=ANSWER_SCHEMA), partial, compression="zstd")
    os.replace(partial, path)


def read_answers(directory: Path, units: int) -> pa.Table:
    """Every unit's answers, in unit order."""
    return pa.concat_tables([pq.read_table(unit_file(directory, unit)) for unit in range(units)])
