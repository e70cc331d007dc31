"""A student judged on an instruction distillation's held-out prompts: its negative
log-likelihood of the teachers' held-out answers (token-weighted, every one), its own
greedy answers (lengths, finish reasons), and a table of (prompt, teacher answer,
student answer) per prompt, the input of an LLM judge.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import ray

from lmforge.data.manifest import read_manifest
from lmforge.errors import UserError
from lmforge.inference.generate import Generator, generate_ids
from lmforge.inference.sampling import SamplingParams
from lmforge.ray_runtime import tune_process

ANSWERS_FILE = "student_answers.jsonl"  # the same rows, in the run directory
NLL_BATCH = 16  # held-out samples scored per forward


def held_out_samples(dataset: Path) -> dict:
    """The held-out split's samples: tokens, loss mask, which prompt each answers and
    its teacher's mean log-probability."""
    manifest = read_manifest(dataset)
    if manifest.instruct is None:
        raise UserError(f"data.path: {dataset} is not an instruction distillation's dataset (`lmforge distill generate` writes one)")
    if manifest.eval is None:
        raise UserError(f"data.path: {dataset} holds no held-out answers to evaluate on; generate it with distill.instruct.eval_fraction > 0")
    files = [str(dataset / manifest.eval.dir / shard.file) for shard in manifest.eval.shards]
    return pq.read_table(files, columns=["tokens", "loss_mask", "prompt_index", "mean_logprob"]).to_pydict()


def prompts_and_answers(samples: dict, limit: int) -> list[dict]:
    """Up to `limit` held-out prompts, in order, each with its teacher answer of the best
    mean log-probability, as token ids: a sample is its prompt, then the answer where
    the loss mask is set (shifted by one: position t predicts token t + 1)."""
    best: dict[int, int] = {}
    for row, (index, score) in enumerate(zip(samples["prompt_index"], samples["mean_logprob"])):
        if index not in best or score > samples["mean_logprob"][best[index]]:
            best[index] = row
    chosen = []
    for index in sorted(best)[:limit]:
        tokens, mask = samples["tokens"][best[index]], np.asarray(samples["loss_mask"][best[index]], dtype=bool)
        first, count = int(np.argmax(mask)), int(mask.sum())
        chosen.append({"prompt_index": index, "prompt_ids": tokens[: first + 1], "answer_ids": tokens[first + 1 : first + 1 + count]})
    return chosen


def evaluate_student(spec, model_path: str, limit: int) -> dict:
    """Score the model at `model_path` (a checkpoint or model directory) on the job's
    held-out answers, and have it answer up to `limit` of the held-out prompts. Runs as
    a Ray task, on a GPU when the cluster has one. Returns {"metrics", "table"}."""
    dataset = Path(spec.data.path)
    samples = held_out_samples(dataset)
    wanted = prompts_and_answers(samples, limit)
    settings = spec.distill.instruct.generate
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    task = _score_and_answer.options(num_cpus=1, num_gpus=gpus)
    return ray.get(task.remote(model_path, str(dataset / "tokenizer.json"), samples["tokens"], samples["loss_mask"], wanted, settings.max_new_tokens))


@ray.remote
def _score_and_answer(model_path: str, tokenizer: str, tokens: list, loss_mask: list, wanted: list[dict], max_new_tokens: int) -> dict:
    import torch

    tune_process(1)
    student = Generator.load(model_path, "cuda" if torch.cuda.is_available() else "cpu", tokenizer=tokenizer)
    nll, counted = _answer_nll(student.model, tokens, loss_mask)
    room = student.model.cfg.max_seq_len
    results = generate_ids(
        student.model,
        [w["prompt_ids"] for w in wanted],
        SamplingParams(max_new_tokens=min(max_new_tokens, room - max(len(w["prompt_ids"]) for w in wanted)), temperature=0),
        student.eos_ids,
        student.tokenizer.get_vocab_size(),
    )
    decode = lambda ids: student.tokenizer.decode(ids, skip_special_tokens=True)
    table = [
        {
            "prompt_index": w["prompt_index"],
            "prompt": decode(w["prompt_ids"]),
            "teacher_answer": decode(w["answer_ids"]),
            "student_answer": decode(r.tokens),
            "student_tokens": len(r.tokens),
            "finish_reason": r.finish_reason,
        }
        for w, r in zip(wanted, results)
    ]
    lengths = [row["student_tokens"] for row in table]
    metrics = {
        "answers_nll": nll,
        "answers_ppl": float(np.exp(nll)),
        "answer_tokens": counted,
        "held_out_prompts": len(table),
        "student_answer_tokens": float(np.mean(lengths)) if lengths else 0.0,
        "teacher_answer_tokens": float(np.mean([len(w["answer_ids"]) for w in wanted])) if wanted else 0.0,
        **{f"student_finish_{reason}": sum(row["finish_reason"] == reason for row in table) / max(len(table), 1) for reason in ("stop", "length")},
    }
    return {"metrics": metrics, "table": table}


def _answer_nll(model, tokens: list, loss_mask: list) -> tuple[float, int]:
    """Mean NLL per answer token over every held-out sample (not per batch: answers differ
    in length), and how many tokens that is."""
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    total, counted = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(tokens), NLL_BATCH):
            batch = torch.tensor(tokens[start : start + NLL_BATCH], dtype=torch.long, device=device)
            mask = torch.tensor(loss_mask[start : start + NLL_BATCH], dtype=torch.bool, device=device)
            logits = model(batch[:, :-1]).float()
            losses = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="none")
            total += losses[mask.flatten()].sum().item()
            counted += int(mask.sum())
    return total / max(counted, 1), counted


def after_training(spec, checkpoint: str, run_dir: Path) -> dict | None:
    """An instruction distillation's trained student on its held-out prompts (when it has
    any, and `distill.instruct.eval_answers`): the table as `student_answers.jsonl` in the
    run directory; returns {"metrics", "table"}, or None."""
    instruct = spec.distill.instruct if spec.distill else None
    if instruct is None or not instruct.eval_answers or read_manifest(spec.data.path).eval is None:
        return None
    result = evaluate_student(spec, checkpoint, instruct.eval_answers)
    with open(Path(run_dir) / ANSWERS_FILE, "w") as out:
        out.writelines(json.dumps(row) + "\n" for row in result["table"])
    return result
