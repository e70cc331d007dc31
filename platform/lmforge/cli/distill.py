"""`lmforge distill cache | generate | run`: a distillation's offline teacher cache, its
teachers' answers, and pipelines of stages."""

from __future__ import annotations

from lmforge.cli import common
from lmforge.distill_jobs.pipeline_file import load_pipeline
from lmforge.spec import load_spec


def add_parsers(sub) -> None:
    distill = sub.add_parser("distill", help="distillation commands").add_subparsers(dest="distill_command", required=True)
    cache = distill.add_parser("cache", help="run a distillation job's teachers over its dataset into the offline top-k cache (distill.cache)")
    common.add_job(cache, help="job YAML file with a distill section naming teacher, top_k and cache")
    common.add_cluster(cache)
    cache.set_defaults(run=cache_command)

    answers = distill.add_parser("generate", help="have a distillation job's teachers answer distill.instruct.prompts into its dataset (data.path)")
    common.add_job(answers, help="job YAML file with a distill section naming teacher(s) and an instruct section")
    common.add_cluster(answers)
    answers.set_defaults(run=answers_command)

    stages = distill.add_parser("run", help="run a distillation pipeline's stages in order, each from the previous stage's student (resumes)")
    stages.add_argument("pipeline", help="pipeline YAML file: name, stages [{name, kind: train|instruct|evaluate, job, set}]")
    common.add_cluster(stages)
    common.add_json(stages)
    stages.set_defaults(run=pipeline_command)


def cache_command(args) -> int:
    spec = load_spec(args.job, args.overrides)
    manifest = common.sdk().build_cache(spec, address=args.address, show_progress=not args.no_progress)
    where = spec.with_absolute_paths().distill
    tokens = manifest.dataset.num_samples * manifest.dataset.seq_len
    common.say(
        f"cached the teacher's top {manifest.k} at temperature {manifest.temperature:g} for {tokens:,} tokens "
        f"({manifest.dataset.eval_samples:,} held-out samples too): {manifest.bytes_per_token:g} bytes per token, "
        f"dense bf16 logits {manifest.dense_bf16_bytes_per_token:,}; {manifest.seconds} s -> {where.cache if where else ''}"
    )
    return 0


def answers_command(args) -> int:
    spec = load_spec(args.job, args.overrides)
    manifest = common.sdk().generate_answers(spec, address=args.address, show_progress=not args.no_progress)
    counts = manifest.instruct.counts
    dropped = ", ".join(f"{n} {rule.replace('_', ' ')}" for rule, n in counts.dropped.items() if n) or "none"
    common.say(
        f"{counts.prompts:,} prompts ({counts.prompt_too_long:,} too long), {counts.answers:,} answers, kept {counts.kept:,} "
        f"(dropped: {dropped}); {manifest.num_samples:,} training samples, {manifest.eval_samples:,} held out; "
        f"{manifest.seconds} s -> {spec.with_absolute_paths().data.path}"
    )
    return 0


def pipeline_command(args) -> int:
    load_pipeline(args.pipeline)  # a bad pipeline or stage job fails before torch and Ray load
    result = common.sdk().run_pipeline(args.pipeline, address=args.address, show_progress=not args.no_progress)
    if args.json:
        return common.print_json(result.as_json(), args.stdout)
    lines = [f"done: pipeline {result.pipeline} ({result.directory})"]
    for name, done in result.stages.items():
        if done is None:
            continue
        numbers = done.numbers
        shown = ", ".join(f"{key} {numbers[key]:.4f}" for key in ("final_loss", "eval_loss", "answers_nll") if numbers.get(key) is not None)
        lines.append(f"  {name:<14}: {done.kind}, {shown}" + (f" -> {done.student}" if done.student else ""))
    if result.mlflow_run_id:
        lines.append(f"  MLflow run    : {result.mlflow_run_id} ({result.mlflow_tracking_uri}), the stages' runs nested under it")
    print("\n".join(lines))
    return 0
