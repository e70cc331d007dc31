"""`lmforge` command line: thin wrappers over `lmforge.sdk`.

Bad input (a `UserError`) prints one line and exits 2 without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from lmforge.errors import TrainingFailed, UserError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmforge", description="Elastic LLM training on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a job file (resumes from its latest checkpoint)")
    train.add_argument("job", help="job YAML file")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a field, e.g. train.max_steps=10")
    train.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local cluster)")
    train.add_argument("--no-progress", action="store_true", help="no progress output")
    train.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")

    data = sub.add_parser("data", help="dataset commands").add_subparsers(dest="data_command", required=True)
    prep = data.add_parser("prepare", help="tokenize and pack a corpus into Parquet shards")
    prep.add_argument("job", nargs="?", help="take source, path, seq_len and tokenizer from this job file")
    prep.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    prep.add_argument("--source", help="file, directory, URI, or builtin:python-stdlib")
    prep.add_argument("--out", help="output directory for shards and manifest.json")
    prep.add_argument("--seq-len", type=int)
    prep.add_argument("--tokenizer", help="tokenizer.json (default: train a byte-level BPE)")
    prep.add_argument("--vocab-size", type=int, default=8192)
    prep.add_argument("--text-column", help="JSONL/Parquet field holding the text (default: text)")
    prep.add_argument("--shard-samples", type=int, default=2048)
    prep.add_argument("--eval-fraction", type=float, help="hold this share of the documents out of training (the held-out split)")
    prep.add_argument("--eval-source", help="a separate corpus as the held-out split")
    prep.add_argument("--address")
    prep.add_argument("--no-progress", action="store_true")

    distill = sub.add_parser("distill", help="distillation commands").add_subparsers(dest="distill_command", required=True)
    cache = distill.add_parser("cache", help="run a distillation job's teachers over its dataset into the offline top-k cache (distill.cache)")
    cache.add_argument("job", help="job YAML file with a distill section naming teacher, top_k and cache")
    cache.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    cache.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local cluster)")
    cache.add_argument("--no-progress", action="store_true")
    answers = distill.add_parser("generate", help="have a distillation job's teachers answer distill.instruct.prompts into its dataset (data.path)")
    answers.add_argument("job", help="job YAML file with a distill section naming teacher(s) and an instruct section")
    answers.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    answers.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local cluster)")
    answers.add_argument("--no-progress", action="store_true")

    stages = distill.add_parser("run", help="run a distillation pipeline's stages in order, each from the previous stage's student (resumes)")
    stages.add_argument("pipeline", help="pipeline YAML file: name, stages [{name, kind: train|instruct|evaluate, job, set}]")
    stages.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local cluster)")
    stages.add_argument("--no-progress", action="store_true")
    stages.add_argument("--json", action="store_true", help="print the result as JSON on stdout")

    export = sub.add_parser("export", help="write a model directory (config.json, model.safetensors, tokenizer) from a checkpoint")
    export.add_argument("checkpoint", help="a committed step directory (e.g. runs/NAME/checkpoints/step_00000100), an lmforge export or a Hugging Face Llama directory")
    export.add_argument("--out", required=True, help="new directory to write (usable as model.init_from)")
    export.add_argument("--format", default="lmforge", help="lmforge (default) or hf: a directory transformers loads with no custom code")
    export.add_argument("--dtype", default="fp32", help="fp32 (default), bf16 or fp16")
    export.add_argument("--tokenizer", help="tokenizer.json to ship (default: the dataset's the checkpoint was trained on)")

    gen = sub.add_parser("generate", help="generate text from a model: a checkpoint, an lmforge export or a Hugging Face directory")
    gen.add_argument("model", help="a committed step directory, an lmforge export or a Hugging Face Llama directory")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1.0)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens holding this much probability")
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, help="make sampling repeatable")
    gen.add_argument("--stop", action="append", default=[], help="a string that ends the answer (repeatable)")
    gen.add_argument("--tokenizer", help="tokenizer.json (default: the model's, or its dataset's)")
    gen.add_argument("--device", help="cpu or cuda (default: cuda when there is one)")
    gen.add_argument("--dtype", default="fp32", help="fp32 (default), bf16 or fp16")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt: text, tokens, logprobs, finish_reason")

    plan = sub.add_parser("plan", help="per-rank memory breakdown of a job, and the layouts that fit a cluster")
    plan.add_argument("job", help="job YAML file")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument("--cluster", help='devices to plan for, e.g. "nodes=4,gpus_per_node=8,gpu_mem=80GB" (--search: default, the job\'s world size in 8 x 80 GB nodes)')
    plan.add_argument("--search", action="store_true", help="rank the layouts that fit the cluster by a step-time model")
    plan.add_argument("--top", type=int, default=5, help="--search: how many layouts to show (default 5)")
    plan.add_argument("--chart", help="PNG bar chart to write (default <output_dir>/<name>/memory-plan.png)")
    plan.add_argument("--no-chart", action="store_true", help="write no chart")
    plan.add_argument("--json", action="store_true", help="print the result as JSON")

    sub.add_parser("version", help="print the version")
    return parser


def _prepare_options(args):
    from lmforge.data.prepare import PrepareOptions

    if args.job:
        from lmforge.spec import load_spec

        spec = load_spec(args.job, args.overrides)
        if not spec.data.source:
            raise UserError(f"{args.job}: data.source is not set; nothing to prepare")
        return PrepareOptions.for_job(
            spec, source=args.source, out=args.out, seq_len=args.seq_len, tokenizer=args.tokenizer, text_column=args.text_column,
            eval_fraction=args.eval_fraction, eval_source=args.eval_source, show_progress=not args.no_progress, names=_typed_flags(args),
        )
    missing = [flag for flag, value in (("--source", args.source), ("--out", args.out), ("--seq-len", args.seq_len)) if value is None]
    if missing:
        raise UserError(f"data prepare: give a job file or {', '.join(missing)}")
    return PrepareOptions(
        source=args.source, out=args.out, seq_len=args.seq_len, tokenizer=args.tokenizer,
        vocab_size=args.vocab_size, text_column=args.text_column or "text", shard_samples=args.shard_samples,
        eval_fraction=args.eval_fraction or 0.0, eval_source=args.eval_source, show_progress=not args.no_progress, names=_typed_flags(args, every=True),
    )


def _typed_flags(args, every: bool = False) -> dict:
    """The options given as flags (`every`: all of them, there being no job file), so
    a message names the flag rather than a job field."""
    from lmforge.data.precheck import FLAGS

    return {key: flag for key, flag in FLAGS.items() if every or getattr(args, key) is not None}


def _cmd_prepare(args) -> int:
    from pathlib import Path

    opts = _prepare_options(args)
    from lmforge import sdk
    from lmforge.data.prepare import MANIFEST, read_manifest

    if (Path(opts.out) / MANIFEST).exists():
        manifest = read_manifest(opts.out)
        print(f"{opts.out}: already prepared ({manifest['num_samples']} samples); nothing to do", file=sys.stderr)
        return 0
    manifest = sdk.prepare(opts, address=args.address)
    held = manifest.get("eval")
    print(
        f"prepared {manifest['num_samples']:,} samples of {manifest['seq_len']}+1 tokens "
        f"({manifest['documents']} documents, {manifest['skipped_documents']} skipped) in {manifest['seconds']}s -> {opts.out}"
        + (f"; held out: {held['num_samples']:,} samples of {held['documents']} documents" if held else ""),
        file=sys.stderr,
    )
    return 0


def _cmd_train(args) -> int:
    from lmforge.spec import load_spec

    spec = load_spec(args.job, args.overrides)  # a bad job file fails before torch and Ray load
    from lmforge import sdk

    summary = sdk.train(spec, address=args.address, show_progress=not args.no_progress)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    lines = [
        f"done: {spec.name} reached step {summary['final_step']}, loss {summary['final_loss']:.4f}" if summary["final_loss"] is not None else f"done: {spec.name} already at step {summary['final_step']}",
        f"  run directory : {summary['run_dir']}",
        f"  checkpoints   : {summary['latest_checkpoint']}",
    ]
    if summary["mlflow_run_id"]:
        lines += [
            f"  MLflow run    : {summary['mlflow_run_id']} ({summary['mlflow_tracking_uri']})",
            *([f"  MLflow job run: {summary['mlflow_parent_run_id']} (its stages' runs nested: cache or generate, train, evaluation)"]
              if summary.get("mlflow_parent_run_id") else []),
            f"  open the UI   : mlflow ui --backend-store-uri {summary['mlflow_tracking_uri']}",
        ]
    print("\n".join(lines))
    return 0


def _cmd_pipeline(args) -> int:
    from lmforge.distill.pipeline import load_pipeline

    load_pipeline(args.pipeline)  # a bad pipeline or stage job fails before torch and Ray load
    from lmforge import sdk

    result = sdk.run_pipeline(args.pipeline, address=args.address, show_progress=not args.no_progress)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    lines = [f"done: pipeline {result['pipeline']} ({result['directory']})"]
    for name, done in result["stages"].items():
        numbers = done.get("summary", {}) | done.get("metrics", {})
        shown = ", ".join(f"{key} {numbers[key]:.4f}" for key in ("final_loss", "eval_loss", "answers_nll") if numbers.get(key) is not None)
        lines.append(f"  {name:<14}: {done['kind']}, {shown}" + (f" -> {done['student']}" if done.get("student") else ""))
    if result["mlflow_run_id"]:
        lines.append(f"  MLflow run    : {result['mlflow_run_id']} ({result['mlflow_tracking_uri']}), the stages' runs nested under it")
    print("\n".join(lines))
    return 0


def _cmd_distill(args) -> int:
    if args.distill_command == "run":
        return _cmd_pipeline(args)
    from lmforge.spec import load_spec

    spec = load_spec(args.job, args.overrides)
    from lmforge import sdk

    if args.distill_command == "generate":
        manifest = sdk.generate_answers(spec, address=args.address, show_progress=not args.no_progress)
        counts = manifest["instruct"]["counts"]
        dropped = ", ".join(f"{n} {rule.replace('_', ' ')}" for rule, n in counts["dropped"].items() if n) or "none"
        print(f"{counts['prompts']:,} prompts ({counts['prompt_too_long']:,} too long), {counts['answers']:,} answers, kept {counts['kept']:,} "
              f"(dropped: {dropped}); {manifest['num_samples']:,} training samples, {manifest.get('eval', {}).get('num_samples', 0):,} held out; "
              f"{manifest['seconds']} s -> {spec.with_absolute_paths().data.path}", file=sys.stderr)
        return 0
    manifest = sdk.build_cache(spec, address=args.address, show_progress=not args.no_progress)
    tokens = manifest["dataset"]["num_samples"] * manifest["dataset"]["seq_len"]
    print(f"cached the teacher's top {manifest['k']} at temperature {manifest['temperature']:g} for {tokens:,} tokens "
          f"({manifest['dataset']['eval_samples']:,} held-out samples too): {manifest['bytes_per_token']:g} bytes per token, "
          f"dense bf16 logits {manifest['dense_bf16_bytes_per_token']:,}; {manifest['seconds']} s -> {spec.with_absolute_paths().distill.cache}",
          file=sys.stderr)
    return 0


def _cmd_export(args) -> int:
    from lmforge.checkpoint.export import export_model

    result = export_model(args.checkpoint, args.out, fmt=args.format, dtype=args.dtype, tokenizer=args.tokenizer)
    what = f"step {result['step']}" if result["step"] is not None else f"a {result['from']} model"
    print(f"exported {what} as {result['format']} {args.dtype} ({result['parameters']:,} parameters"
          f"{', with its tokenizer' if result['tokenizer'] else ', no tokenizer'}) -> {result['out']}", file=sys.stderr)
    return 0


GENERATE_FLAGS = {key: "--" + key.replace("_", "-") for key in ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "stop", "prompt")}


def _cmd_generate(args) -> int:
    from lmforge.inference.generate import Generator
    from lmforge.inference.sampling import SamplingParams
    from lmforge.sdk import default_device

    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
    )
    params.check(GENERATE_FLAGS)  # before the model loads
    generator = Generator.load(args.model, args.device or default_device(), args.dtype, args.tokenizer)
    for prompt, result in zip(args.prompt, generator.generate(args.prompt, params, GENERATE_FLAGS)):
        if args.json:
            print(json.dumps({"prompt": prompt} | result.as_dict()))
        else:
            print(prompt + result.text)
            print(f"[{len(result.tokens)} tokens, {result.finish_reason}]", file=sys.stderr)
    return 0


def _cmd_plan(args) -> int:
    from lmforge.planner.command import plan

    return plan(args)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Ray Data logs every dataset execution at INFO; the CLI shows its own progress.
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "WARNING")
    try:
        if args.command == "version":
            from lmforge import __version__

            print(__version__)
            return 0
        commands = {"data": _cmd_prepare, "distill": _cmd_distill, "export": _cmd_export, "generate": _cmd_generate, "plan": _cmd_plan, "train": _cmd_train}
        return commands[args.command](args)
    except UserError as err:
        print(f"lmforge: error: {err}", file=sys.stderr)
        return err.exit_code
    except TrainingFailed as err:
        print(f"lmforge: training failed: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("lmforge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
