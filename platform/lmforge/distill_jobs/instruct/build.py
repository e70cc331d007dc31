"""`lmforge distill generate JOB`: prompts -> the teachers' answers (a Ray Data actor
pool, one unit of prompts per call) -> selection -> SFT samples with a loss mask and
soft targets -> Parquet shards and a manifest at `data.path`.

Units' answers go to a work directory beside `data.path` as each unit finishes; a
rerun with the same settings keeps them and answers only the rest, so every prompt
is answered once and the result is what one uninterrupted run writes. The dataset
itself appears whole (staged, then renamed) or not at all, with every answer in its
`answers/` directory.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import ray
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from lmforge.chat import chat_template_of
from lmforge.checkpoint.export import open_source
from lmforge.console import text_column
from lmforge.data.manifest import (
    EVAL_DIR,
    DatasetManifest,
    HeldOutSplit,
    InstructCounts,
    InstructIdentity,
    InstructRecord,
    PromptsRecord,
    SoftTargets,
    TokenizerRecord,
    write_manifest,
)
from lmforge.data.packing import ShardWriter
from lmforge.data.staging import staged
from lmforge.data.tokenizer import end_of_text_token, eos_id, load_tokenizer, tokenizer_sha256
from lmforge.distill.cache_manifest import teacher_records
from lmforge.distill_jobs.instruct.answers import TeacherAnswers, read_answers, unit_file
from lmforge.distill_jobs.instruct.prompts import read_prompts
from lmforge.distill_jobs.instruct.samples import write_samples
from lmforge.distill_jobs.instruct.selection import RULES, select
from lmforge.distill_jobs.teacher_cache import actor_pool
from lmforge.errors import UserError
from lmforge.preflight import check_generation, check_teachers

SETTINGS = "settings.json"
ANSWERS_DIR = "answers"  # inside the dataset: every answer generated, kept or not


@dataclass
class Plan:
    """What a generation will do, all checked before anything starts."""

    units: list[list[tuple[int, bool, list[int]]]]  # per unit: (prompt index, held out, token ids)
    prompts: int
    held_out: int
    too_long: int
    tokenizer: object
    eos: int
    identity: InstructIdentity  # a rerun keeps units only when it is equal


def answers_dir(spec) -> Path:
    out = Path(spec.data.path)
    return out.parent / f".{out.name}.answers"


def plan_generation(spec) -> Plan:
    """Teachers, tokenizer, chat template and prompts, checked; prompts that cannot fit the
    teachers' context or a training sample with max_new_tokens are dropped and counted,
    and when none fits that is refused."""

    check_generation(spec)
    d, instruct = spec.distill, spec.distill.instruct
    names = ["distill.teacher"] if d.teacher else [f"distill.teachers[{i}]" for i in range(len(d.sources))]
    teachers = [open_source(s.path, name=name) for s, name in zip(d.sources, names)]
    tokenizer, eos_token = _tokenizer(spec, teachers[0], names[0])
    check_teachers(spec, None, spec.data.tokenizer or tokenizer)
    teacher_dir = teachers[0].path if teachers[0].kind != "checkpoint" else None
    template = chat_template_of(teacher_dir, instruct.chat_template, "distill.instruct.chat_template")
    prompts = read_prompts(instruct, template)
    room = min(spec.train.seq_len + 1, *(t.cfg.max_seq_len for t in teachers)) - instruct.generate.max_new_tokens
    encoded = [tokenizer.encode(p.text, add_special_tokens=not p.chat) for p in prompts]
    fitting = [(p.index, p.held_out, e.ids) for p, e in zip(prompts, encoded) if 0 < len(e.ids) <= room]
    if not fitting:
        raise UserError(
            f"distill.instruct.prompts: none of the {len(prompts)} prompts fits: a prompt and "
            f"distill.instruct.generate.max_new_tokens {instruct.generate.max_new_tokens} must fit in train.seq_len + 1 "
            f"= {spec.train.seq_len + 1} tokens and the teachers' context; the shortest prompt has "
            f"{min(len(e.ids) for e in encoded)} tokens"
        )
    size = instruct.prompts_per_shard
    units = [fitting[i : i + size] for i in range(0, len(fitting), size)]
    identity = InstructIdentity(
        prompts=PromptsRecord(uri=instruct.prompts, sha256=hashlib.sha256(json.dumps([p.text for p in prompts]).encode()).hexdigest()),
        teachers=teacher_records(d),
        tokenizer_sha256=tokenizer_sha256(tokenizer),
        generate=instruct.generate.model_dump(),
        eval_fraction=instruct.eval_fraction,
        prompts_per_shard=size,
        seq_len=spec.train.seq_len,
        soft_targets=SoftTargets(k=d.top_k, temperature=d.temperature) if d.top_k else None,
    )
    return Plan(units, len(prompts), sum(p.held_out for p in prompts), len(prompts) - len(fitting), tokenizer, eos_id(tokenizer, eos_token), identity)


def _tokenizer(spec, teacher, name: str):
    """data.tokenizer, else the first teacher's (every teacher is then checked against it)."""
    if spec.data.tokenizer:
        return load_tokenizer(spec.data.tokenizer), end_of_text_token(spec.data.tokenizer)
    if teacher.tokenizer_json is None:
        raise UserError(f"{name}: {teacher.path} has no tokenizer to turn prompts into tokens; set data.tokenizer")
    return teacher.tokenizer(), teacher.eos_token


def generate_dataset(spec, plan: Plan, show_progress: bool = True) -> DatasetManifest:
    """Answer the job's prompts (as `plan_generation` checked them) into an SFT dataset at
    `data.path`; returns its manifest. Requires an initialized Ray session."""
    began = time.time()
    work = _work_dir(spec, plan, show_progress)
    pending = [u for u in range(len(plan.units)) if not unit_file(work, u).is_file()]
    if pending:
        _answer_units(spec, plan, work, pending, show_progress)
    return _write_dataset(spec, plan, work, time.time() - began)


def _work_dir(spec, plan: Plan, show_progress: bool) -> Path:
    """The answers of an interrupted run with the same settings, or a fresh directory."""
    work = answers_dir(spec)
    settings = work / SETTINGS
    if settings.is_file() and json.loads(settings.read_text()) == plan.identity.model_dump(mode="json"):
        done = sum(unit_file(work, u).is_file() for u in range(len(plan.units)))
        if done and show_progress:
            print(f"resuming: {done} of {len(plan.units)} units of prompts already answered in {work}")
        return work
    if work.exists():
        if show_progress:
            print(f"{work} holds answers made with other settings: starting over")
        shutil.rmtree(work)
    work.mkdir(parents=True)
    settings.write_text(plan.identity.model_dump_json(indent=2))
    return work


def answered_units(spec, plan: Plan, work: Path, pending: list[int]) -> Iterator[tuple[list[int], int]]:
    """The teachers' actor pool over the `pending` units, each unit's answers written to
    `work` by the actor; yields (the units just written, their new tokens) as they come."""
    d = spec.distill
    pool = actor_pool(ray.cluster_resources(), d.instruct.actors)
    writer = {
        "paths": [str(s.path) for s in d.sources],
        "settings": d.instruct.generate.model_dump(),
        "eos_id": plan.eos,
        "vocab": plan.tokenizer.get_vocab_size(),
        "soft_targets": (d.top_k, d.temperature) if d.top_k else None,
        "out_dir": str(work),
        "threads": pool["threads"],
    }
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    items = [{"unit": u, "prompts": json.dumps([[i, held, ids] for i, held, ids in plan.units[u]])} for u in pending]
    answered = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        TeacherAnswers,
        fn_constructor_kwargs=writer,
        batch_size=1,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=pool["concurrency"]),
        num_cpus=pool.get("num_cpus", 0),
        num_gpus=pool.get("num_gpus", 0),
    )
    for batch in answered.iter_batches(batch_size=None, batch_format="numpy"):
        yield [int(u) for u in batch["unit"]], int(batch["tokens"].sum())


def _answer_units(spec, plan: Plan, work: Path, pending: list[int], show_progress: bool) -> None:
    prompts = sum(len(plan.units[u]) for u in pending)
    with _progress(show_progress) as progress:
        task = progress.add_task("answering prompts", total=prompts, rate="") if progress else None
        began, tokens = time.time(), 0
        for units, new_tokens in answered_units(spec, plan, work, pending):
            tokens += new_tokens
            if progress is not None:
                seconds = max(time.time() - began, 1e-9)
                progress.update(task, advance=sum(len(plan.units[u]) for u in units), rate=f"{tokens / seconds:,.0f} tokens/s")


def _progress(enabled: bool):
    if not enabled:
        return nullcontext()  # enters as None: no bar
    return Progress(
        text_column("{task.description}", bold=True), BarColumn(), MofNCompleteColumn(), text_column("{task.fields[rate]}"), TimeElapsedColumn()
    )


def _write_dataset(spec, plan: Plan, work: Path, seconds: float) -> DatasetManifest:
    """The kept answers as the dataset's samples, and every answer (what selection
    dropped too) in its `answers/` directory, for audit and evaluation."""
    d = spec.distill
    answers = read_answers(work, len(plan.units))
    kept, dropped = select(answers, d.instruct.select, len(d.sources))
    held = answers.column("held_out").to_pylist()
    out = Path(spec.data.path)
    with staged(out) as staging:
        splits = {}
        for name, directory, rows in (
            ("train", staging, [r for r in kept if not held[r]]),
            ("eval", staging / EVAL_DIR, [r for r in kept if held[r]]),
        ):
            if not rows:
                continue
            directory.mkdir(exist_ok=True)
            writer = ShardWriter(directory, spec.train.seq_len, spec.data.shard_samples)
            learnt = write_samples(writer, answers, rows, spec.train.seq_len, plan.eos, d.top_k)
            writer.close()
            splits[name] = (writer, learnt)
        if "train" not in splits:
            raise UserError(
                f"distill.instruct.select: no answer to train on is left ({answers.num_rows} answers, "
                + ", ".join(f"{n} {rule}" for rule, n in dropped.items() if n)
                + "); loosen the rules or give more prompts"
            )
        manifest = _manifest(spec, plan, answers, dropped, splits, seconds)
        plan.tokenizer.save(str(staging / "tokenizer.json"))
        write_manifest(staging, manifest)
        work.rename(staging / ANSWERS_DIR)
        return manifest


def _manifest(spec, plan: Plan, answers: pa.Table, dropped: dict, splits: dict, seconds: float) -> DatasetManifest:
    instruct, seq_len = spec.distill.instruct, spec.train.seq_len
    writer, learnt = splits["train"]
    counts = InstructCounts(
        prompts=plan.prompts,
        held_out_prompts=plan.held_out,
        prompt_too_long=plan.too_long,
        answers=answers.num_rows,
        dropped={rule: dropped[rule] for rule in RULES},
        kept=sum(s[0].next_id for s in splits.values()),
        answer_tokens=learnt,
    )
    held = None
    if "eval" in splits:
        held_writer, held_learnt = splits["eval"]
        held = HeldOutSplit(
            source=instruct.prompts,
            fraction=instruct.eval_fraction,
            documents=plan.held_out,
            num_samples=held_writer.next_id,
            corpus_tokens=held_learnt,
            shards=held_writer.shards,
        )
    return DatasetManifest(
        source=instruct.prompts,
        seq_len=seq_len,
        num_samples=writer.next_id,
        num_tokens=writer.next_id * (seq_len + 1),
        shard_samples=spec.data.shard_samples,
        corpus_tokens=learnt,
        documents=plan.prompts,
        skipped_documents=plan.too_long,
        tokenizer=TokenizerRecord(
            file="tokenizer.json", sha256=tokenizer_sha256(plan.tokenizer), vocab_size=plan.tokenizer.get_vocab_size(), eos_id=plan.eos
        ),
        shards=writer.shards,
        instruct=InstructRecord(**dict(plan.identity), select=instruct.select.model_dump(), counts=counts),
        seconds=round(seconds, 2),
        eval=held,
    )
