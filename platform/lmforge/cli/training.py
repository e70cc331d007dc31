"""`lmforge train | data prepare | plan`: a job's data, its memory plan, and its run."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmforge.cli import common
from lmforge.console import text_console
from lmforge.data.manifest import has_manifest, read_manifest
from lmforge.data.precheck import FLAGS
from lmforge.data.prepare_options import PrepareOptions
from lmforge.errors import UserError
from lmforge.jobs.client import submitted_spec
from lmforge.spec import load_spec


def add_parsers(sub) -> None:
    train = sub.add_parser("train", help="train a job file (resumes from its latest checkpoint)")
    common.add_job(train, required=False)
    common.add_cluster(train)
    common.add_json(train, "the summary")
    # `lmforge submit`'s entrypoint on the cluster: the job from the environment, events streamed on stdout.
    train.add_argument("--submitted", action="store_true", help=argparse.SUPPRESS)
    train.set_defaults(run=train_command)

    data = sub.add_parser("data", help="dataset commands").add_subparsers(dest="data_command", required=True)
    prep = data.add_parser("prepare", help="tokenize and pack a corpus into Parquet shards")
    common.add_job(prep, required=False, help="take source, path, seq_len and tokenizer from this job file")
    prep.add_argument("--source", help="file, directory, URI, or builtin:python-stdlib")
    prep.add_argument("--out", help="output directory for shards and manifest.json")
    prep.add_argument("--seq-len", type=int)
    prep.add_argument("--tokenizer", help="tokenizer.json (default: train a byte-level BPE)")
    prep.add_argument("--vocab-size", type=int, help="of the BPE trained when no tokenizer is given (default 8192)")
    prep.add_argument("--text-column", help="JSONL/Parquet field holding the text (default: text)")
    prep.add_argument("--shard-samples", type=int, help="samples per Parquet shard (default 2048; with a job file, its data.shard_samples)")
    prep.add_argument("--eval-fraction", type=float, help="hold this share of the documents out of training (the held-out split)")
    prep.add_argument("--eval-source", help="a separate corpus as the held-out split")
    common.add_cluster(prep)
    prep.set_defaults(run=prepare_command)

    plan = sub.add_parser("plan", help="per-rank memory breakdown of a job, and the layouts that fit a cluster")
    common.add_job(plan)
    plan.add_argument(
        "--cluster",
        help='devices to plan for, e.g. "nodes=4,gpus_per_node=8,gpu_mem=80GB" (--search: default, the job\'s world size in 8 x 80 GB nodes)',
    )
    plan.add_argument("--search", action="store_true", help="rank the layouts that fit the cluster by a step-time model")
    plan.add_argument("--top", type=int, default=5, help="--search: how many layouts to show (default 5)")
    plan.add_argument("--serve", action="store_true", help="a serving replica of the job's model instead: weights and KV cache")
    plan.add_argument("--sequences", type=int, default=16, help="--serve: sequences decoding together (default 16, as lmforge serve's)")
    plan.add_argument("--context", type=int, help="--serve: positions per sequence (default: the model's max_seq_len)")
    plan.add_argument("--dtype", default="fp32", help="--serve: the weights' and cache's dtype: fp32 (lmforge serve's), bf16 or fp16")
    plan.add_argument("--chart", help="PNG bar chart to write (default <output_dir>/<name>/memory-plan.png)")
    plan.add_argument("--no-chart", action="store_true", help="write no chart")
    common.add_json(plan)
    plan.set_defaults(run=plan_command)


def train_command(args) -> int:
    if args.submitted:
        spec = submitted_spec(args.overrides)
    elif args.job is None:
        raise UserError("train: give a job file")
    else:
        spec = load_spec(args.job, args.overrides)  # a bad job file fails before torch and Ray load
    summary = common.sdk().train(spec, address=args.address, show_progress=not args.no_progress, stream_events=args.submitted)
    if args.json:
        return common.print_json(summary.as_json(), args.stdout)
    lines = [
        f"done: {spec.name} reached step {summary.final_step}, loss {summary.final_loss:.4f}"
        if summary.final_loss is not None
        else f"done: {spec.name} already at step {summary.final_step}",
        f"  run directory : {summary.run_dir}",
        f"  checkpoints   : {summary.latest_checkpoint}",
    ]
    if summary.mlflow_run_id:
        lines += [
            f"  MLflow run    : {summary.mlflow_run_id} ({summary.mlflow_tracking_uri})",
            *(
                [f"  MLflow job run: {summary.mlflow_parent_run_id} (its stages' runs nested: cache or generate, train, evaluation)"]
                if summary.mlflow_parent_run_id
                else []
            ),
            f"  open the UI   : mlflow ui --backend-store-uri {summary.mlflow_tracking_uri}",
        ]
    print("\n".join(lines))
    return 0


def prepare_command(args) -> int:
    opts = _prepare_options(args)
    if has_manifest(opts.out):
        manifest = read_manifest(opts.out)
        common.say(f"{opts.out}: already prepared ({manifest.num_samples} samples); nothing to do")
        return 0
    manifest = common.sdk().prepare(opts, address=args.address)
    held = manifest.eval
    common.say(
        f"prepared {manifest.num_samples:,} samples of {manifest.seq_len}+1 tokens "
        f"({manifest.documents} documents, {manifest.skipped_documents} skipped) in {manifest.seconds}s -> {opts.out}"
        + (f"; held out: {held.num_samples:,} samples of {held.documents} documents" if held else "")
    )
    return 0


def _prepare_options(args):
    if args.job:
        spec = load_spec(args.job, args.overrides)
        if not spec.data.source:
            raise UserError(f"{args.job}: data.source is not set; nothing to prepare")
        return PrepareOptions.for_job(
            spec,
            source=args.source,
            out=args.out,
            seq_len=args.seq_len,
            tokenizer=args.tokenizer,
            text_column=args.text_column,
            eval_fraction=args.eval_fraction,
            eval_source=args.eval_source,
            shard_samples=args.shard_samples,
            vocab_size=args.vocab_size,
            show_progress=not args.no_progress,
            names=_typed_flags(args),
        )
    missing = [flag for flag, value in (("--source", args.source), ("--out", args.out), ("--seq-len", args.seq_len)) if value is None]
    if missing:
        raise UserError(f"data prepare: give a job file or {', '.join(missing)}")
    return PrepareOptions(
        source=args.source,
        out=args.out,
        seq_len=args.seq_len,
        tokenizer=args.tokenizer,
        vocab_size=8192 if args.vocab_size is None else args.vocab_size,
        text_column=args.text_column or "text",
        shard_samples=2048 if args.shard_samples is None else args.shard_samples,
        eval_fraction=args.eval_fraction or 0.0,
        eval_source=args.eval_source,
        show_progress=not args.no_progress,
        names=_typed_flags(args, every=True),
    )


def _typed_flags(args, every: bool = False) -> dict:
    """The options given as flags (`every`: all of them, there being no job file), so
    a message names the flag rather than a job field."""
    return {key: flag for key, flag in FLAGS.items() if every or getattr(args, key) is not None}


def plan_command(args) -> int:
    spec = load_spec(args.job, args.overrides)
    if args.serve:
        serving = common.sdk().plan_serving(spec, args.sequences, args.context, args.dtype, args.cluster)
        if args.json:
            return common.print_json(serving.as_json(), args.stdout)
        serving.show(text_console(stderr=False))
        return 0
    chart = None if args.no_chart else (args.chart or Path(spec.run_dir) / ("memory-search.png" if args.search else "memory-plan.png"))
    if args.search:
        result = common.sdk().search_layouts(spec, args.cluster, args.top, chart)
    else:
        result = common.sdk().plan(spec, args.cluster, chart)
    if args.json:
        if args.search:
            result.show_assumption(text_console(stderr=True))
        return common.print_json(result.as_json(), args.stdout)
    result.show(text_console(stderr=False))
    return 0
