"""`lmforge` command line: thin wrappers over `lmforge.sdk`.

Bad input (a `UserError`) prints one line and exits 2 without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from lmforge.errors import TrainingFailed, UserError
from lmforge.jobs.commands import COMMANDS as JOB_COMMANDS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmforge", description="Elastic LLM training on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a job file (resumes from its latest checkpoint)")
    train.add_argument("job", nargs="?", help="job YAML file")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a field, e.g. train.max_steps=10")
    train.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local cluster)")
    train.add_argument("--no-progress", action="store_true", help="no progress output")
    train.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    # `lmforge submit`'s entrypoint on the cluster: the job from the environment, events streamed on stdout.
    train.add_argument("--submitted", action="store_true", help=argparse.SUPPRESS)

    data = sub.add_parser("data", help="dataset commands").add_subparsers(dest="data_command", required=True)
    prep = data.add_parser("prepare", help="tokenize and pack a corpus into Parquet shards")
    prep.add_argument("job", nargs="?", help="take source, path, seq_len and tokenizer from this job file")
    prep.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    prep.add_argument("--source", help="file, directory, URI, or builtin:python-stdlib")
    prep.add_argument("--out", help="output directory for shards and manifest.json")
    prep.add_argument("--seq-len", type=int)
    prep.add_argument("--tokenizer", help="tokenizer.json (default: train a byte-level BPE)")
    prep.add_argument("--vocab-size", type=int, help="of the BPE trained when no tokenizer is given (default 8192)")
    prep.add_argument("--text-column", help="JSONL/Parquet field holding the text (default: text)")
    prep.add_argument("--shard-samples", type=int, help="samples per Parquet shard (default 2048; with a job file, its data.shard_samples)")
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
    export.add_argument(
        "checkpoint",
        help="a committed step directory (e.g. runs/NAME/checkpoints/step_00000100), an lmforge export or a Hugging Face Llama directory",
    )
    export.add_argument("--out", required=True, help="new directory to write (usable as model.init_from)")
    export.add_argument("--format", default="lmforge", help="lmforge (default) or hf: a directory transformers loads with no custom code")
    export.add_argument("--dtype", default="fp32", help="fp32 (default), bf16 or fp16")
    export.add_argument("--tokenizer", help="tokenizer.json to ship (default: the dataset's the checkpoint was trained on)")
    export.add_argument(
        "--register",
        action="store_true",
        help="do not log the export to the checkpoint's MLflow run nor register it as a model version (default: do, when it has one)",
    )

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

    quant = sub.add_parser(
        "quantize", help="weight-only int8 or int4 quantization of a model's Linear layers (torchao), with its perplexity and size against the source"
    )
    quant.add_argument("model", help="an lmforge export, a Hugging Face Llama directory or a committed step directory")
    quant.add_argument("--method", required=True, help="int8 (per output channel) or int4 (group-wise)")
    quant.add_argument("--group-size", type=int, default=128, help="int4: weights per scale and zero point (32, 64, 128 or 256; default 128)")
    quant.add_argument("--out", required=True, help="new directory to write (loads in lmforge generate and lmforge serve)")
    quant.add_argument("--eval-data", help="a prepared dataset whose held-out split measures perplexity (default: the one the model was trained on)")
    quant.add_argument("--eval-samples", type=int, default=256, help="held-out samples to measure on (default 256)")
    quant.add_argument("--tokenizer", help="tokenizer.json to ship (default: the model's, or its dataset's)")
    quant.add_argument("--tracking-uri", help="MLflow store (default: MLFLOW_TRACKING_URI, else sqlite:///runs/mlflow.db)")
    quant.add_argument("--no-tracking", action="store_true", help="record no MLflow run")
    quant.add_argument("--json", action="store_true", help="print the report as JSON")

    srv = sub.add_parser("serve", help="serve a model with an OpenAI-compatible API on Ray Serve (continuous batching)")
    srv.add_argument("model", help="an lmforge export, a quantized directory, a Hugging Face Llama directory or a committed step directory")
    srv.add_argument("--name", help="the model's name in requests and /v1/models (default: the directory's name)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--replicas", default="1", help="replicas of the model, or auto (Serve scales 1..--max-replicas on load)")
    srv.add_argument("--max-replicas", type=int, default=4, help="--replicas auto: the most replicas (default 4)")
    srv.add_argument("--batching", default="continuous", help="continuous (default), request (Ray Serve's @serve.batch) or off")
    srv.add_argument("--max-running", type=int, default=16, help="sequences decoding together per replica (default 16)")
    srv.add_argument("--max-waiting", type=int, default=256, help="sequences queued per replica before 503 (default 256)")
    srv.add_argument("--max-n", type=int, default=8, help="the largest n a request may ask for (default 8)")
    srv.add_argument("--cache-size", type=int, default=256, help="temperature-0 responses kept for identical requests (0: none)")
    srv.add_argument("--api-key", help="require Authorization: Bearer KEY on /v1 (default: LMFORGE_API_KEY, else none)")
    srv.add_argument("--route-prefix", default="/", help="URL prefix of this model's routes (several models on one cluster)")
    srv.add_argument("--app-name", help="Serve application name (default: --name)")
    srv.add_argument("--chat-template", help="Jinja chat template file (default: the model's tokenizer_config.json, else lmforge's)")
    srv.add_argument("--tokenizer", help="tokenizer.json (default: the model's, or its dataset's)")
    srv.add_argument("--device", help="cpu or cuda (default: cuda when the cluster has GPUs; each replica then asks for one)")
    srv.add_argument("--cpus-per-replica", type=float, default=1.0)
    srv.add_argument("--threads", type=int, default=1, help="torch threads per replica (default 1)")
    srv.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local cluster)")

    evaluate = sub.add_parser("eval", help="evaluation commands").add_subparsers(dest="eval_command", required=True)
    judge = evaluate.add_parser("judge", help="pairwise LLM-as-judge of two OpenAI-compatible models, each pair judged in both orders")
    judge.add_argument(
        "--a", required=True, help="model A: an OpenAI-compatible base URL (http://host:port/v1, optionally URL#model) or a model directory"
    )
    judge.add_argument("--b", required=True, help="model B: as --a")
    judge.add_argument("--judge", required=True, help="the judge: as --a (any OpenAI-compatible chat model)")
    judge.add_argument("--prompts", required=True, help='JSONL file: one {"prompt": ...} (or {"messages": [...]}) per line')
    judge.add_argument("--out", required=True, help="directory for report.json and judgments.jsonl")
    judge.add_argument("--max-tokens", type=int, default=256, help="answer length for A and B (default 256)")
    judge.add_argument("--judge-max-tokens", type=int, default=512)
    judge.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    judge.add_argument("--a-key", help="API key of --a's endpoint only (default: LMFORGE_JUDGE_A_KEY, else none)")
    judge.add_argument("--b-key", help="API key of --b's endpoint only (default: LMFORGE_JUDGE_B_KEY, else none)")
    judge.add_argument("--judge-key", help="API key of the judge's endpoint only (default: OPENAI_API_KEY, else none)")
    judge.add_argument("--tracking-uri", help="MLflow store (default: MLFLOW_TRACKING_URI, else sqlite:///runs/mlflow.db)")
    judge.add_argument("--no-tracking", action="store_true")
    judge.add_argument("--json", action="store_true", help="print the report as JSON")

    plan = sub.add_parser("plan", help="per-rank memory breakdown of a job, and the layouts that fit a cluster")
    plan.add_argument("job", help="job YAML file")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument(
        "--cluster",
        help='devices to plan for, e.g. "nodes=4,gpus_per_node=8,gpu_mem=80GB" (--search: default, the job\'s world size in 8 x 80 GB nodes)',
    )
    plan.add_argument("--search", action="store_true", help="rank the layouts that fit the cluster by a step-time model")
    plan.add_argument("--top", type=int, default=5, help="--search: how many layouts to show (default 5)")
    plan.add_argument("--chart", help="PNG bar chart to write (default <output_dir>/<name>/memory-plan.png)")
    plan.add_argument("--no-chart", action="store_true", help="write no chart")
    plan.add_argument("--json", action="store_true", help="print the result as JSON")

    from lmforge.jobs.commands import add_parsers as add_job_parsers

    add_job_parsers(sub)
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
    from lmforge.data.precheck import FLAGS

    return {key: flag for key, flag in FLAGS.items() if every or getattr(args, key) is not None}


def _cmd_prepare(args) -> int:
    opts = _prepare_options(args)
    from lmforge import sdk
    from lmforge.data.prepare import has_manifest, read_manifest

    if has_manifest(opts.out):
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

    if args.submitted:
        from lmforge.jobs.client import submitted_spec

        spec = submitted_spec(args.overrides)
    elif args.job is None:
        raise UserError("train: give a job file")
    else:
        spec = load_spec(args.job, args.overrides)  # a bad job file fails before torch and Ray load
    from lmforge import sdk

    summary = sdk.train(spec, address=args.address, show_progress=not args.no_progress, stream_events=args.submitted)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    lines = [
        f"done: {spec.name} reached step {summary['final_step']}, loss {summary['final_loss']:.4f}"
        if summary["final_loss"] is not None
        else f"done: {spec.name} already at step {summary['final_step']}",
        f"  run directory : {summary['run_dir']}",
        f"  checkpoints   : {summary['latest_checkpoint']}",
    ]
    if summary["mlflow_run_id"]:
        lines += [
            f"  MLflow run    : {summary['mlflow_run_id']} ({summary['mlflow_tracking_uri']})",
            *(
                [f"  MLflow job run: {summary['mlflow_parent_run_id']} (its stages' runs nested: cache or generate, train, evaluation)"]
                if summary.get("mlflow_parent_run_id")
                else []
            ),
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
        print(
            f"{counts['prompts']:,} prompts ({counts['prompt_too_long']:,} too long), {counts['answers']:,} answers, kept {counts['kept']:,} "
            f"(dropped: {dropped}); {manifest['num_samples']:,} training samples, {manifest.get('eval', {}).get('num_samples', 0):,} held out; "
            f"{manifest['seconds']} s -> {spec.with_absolute_paths().data.path}",
            file=sys.stderr,
        )
        return 0
    manifest = sdk.build_cache(spec, address=args.address, show_progress=not args.no_progress)
    tokens = manifest["dataset"]["num_samples"] * manifest["dataset"]["seq_len"]
    print(
        f"cached the teacher's top {manifest['k']} at temperature {manifest['temperature']:g} for {tokens:,} tokens "
        f"({manifest['dataset']['eval_samples']:,} held-out samples too): {manifest['bytes_per_token']:g} bytes per token, "
        f"dense bf16 logits {manifest['dense_bf16_bytes_per_token']:,}; {manifest['seconds']} s -> {spec.with_absolute_paths().distill.cache}",
        file=sys.stderr,
    )
    return 0


def _cmd_export(args) -> int:
    from lmforge import sdk

    result = sdk.export(args.checkpoint, args.out, format=args.format, dtype=args.dtype, tokenizer=args.tokenizer, register=args.register)
    what = f"step {result['step']}" if result["step"] is not None else f"a {result['from']} model"
    print(
        f"exported {what} as {result['format']} {args.dtype} ({result['parameters']:,} parameters"
        f"{', with its tokenizer' if result['tokenizer'] else ', no tokenizer'}) -> {result['out']}",
        file=sys.stderr,
    )
    if result.get("registered"):
        registered = result["registered"]
        print(f"registered in MLflow as {registered['name']} version {registered['version']} (run {registered['run_id']})", file=sys.stderr)
    return 0


GENERATE_FLAGS = {
    key: "--" + key.replace("_", "-") for key in ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "stop", "prompt")
}


def _cmd_generate(args) -> int:
    from lmforge import sdk

    sampling = {key: getattr(args, key) for key in ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "stop")}
    results = sdk.generate(args.model, args.prompt, device=args.device, dtype=args.dtype, tokenizer=args.tokenizer, names=GENERATE_FLAGS, **sampling)
    for prompt, result in zip(args.prompt, results):
        if args.json:
            print(json.dumps({"prompt": prompt} | result))
        else:
            print(prompt + result["text"])
            print(f"[{len(result['tokens'])} tokens, {result['finish_reason']}]", file=sys.stderr)
    return 0


def _cmd_quantize(args) -> int:
    from lmforge.quantization.command import QuantizeOptions, quantize_model

    opts = QuantizeOptions(
        model=args.model,
        method=args.method,
        out=args.out,
        group_size=args.group_size,
        eval_data=args.eval_data,
        eval_samples=args.eval_samples,
        tokenizer=args.tokenizer,
        tracking_uri=args.tracking_uri,
        tracking=not args.no_tracking,
    )
    opts.check()  # before torch loads the model
    report = quantize_model(opts, say=lambda line: print(line, file=sys.stderr))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        "\n".join(
            [
                f"quantized {args.model} to {report['method']}"
                + (f" (group {report['group_size']})" if report["group_size"] else "")
                + f" -> {args.out}",
                f"  with          : {report['library']}",
                f"  Linear weights: {report['linear_bytes']:,} bytes, {report['linear_ratio_vs_bf16']:.3f}x bf16 ({report['linear_bytes_bf16']:,})",
                f"  whole model   : {report['model_bytes']:,} bytes, {report['model_ratio_vs_bf16']:.3f}x bf16 ({report['model_bytes_bf16']:,})",
                f"  perplexity    : {report['quantized_perplexity']:.4f} against {report['source_perplexity']:.4f} unquantized "
                f"({100 * (report['perplexity_ratio'] - 1):+.2f}%), {report['eval_samples']} held-out samples of {report['eval_data']}",
                *([f"  MLflow run    : {report['mlflow_run_id']} ({report['mlflow_tracking_uri']})"] if report.get("mlflow_run_id") else []),
            ]
        )
    )
    return 0


def _serve_options(args):
    from pathlib import Path

    from lmforge.serve.api import key_digest
    from lmforge.serve.backend import ServerOptions
    from lmforge.serve.engine import MODES

    if args.batching not in MODES:
        raise UserError(f"--batching: {args.batching!r} is not one of {', '.join(MODES)}")
    if args.replicas != "auto" and not (args.replicas.isdigit() and int(args.replicas) >= 1):
        raise UserError(f"--replicas: a number of at least 1 or auto, got {args.replicas!r}")
    for flag in ("max_running", "max_waiting", "max_n", "threads", "max_replicas", "port"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")
    if args.port > 65535:
        raise UserError(f"--port: must be at most 65535, got {args.port}")
    if not args.cpus_per_replica > 0:
        raise UserError(f"--cpus-per-replica: must be > 0, got {args.cpus_per_replica}")
    if args.route_prefix != "/" and (args.route_prefix.endswith("/") or "{" in args.route_prefix or "}" in args.route_prefix):
        raise UserError(f"--route-prefix: a path like /name, not ending in / and without braces, got {args.route_prefix!r}")
    if args.cache_size < 0:
        raise UserError(f"--cache-size: must be >= 0, got {args.cache_size}")
    if not args.route_prefix.startswith("/"):
        raise UserError(f"--route-prefix: must start with /, got {args.route_prefix!r}")
    if args.chat_template and not Path(args.chat_template).is_file():
        raise UserError(f"--chat-template: {args.chat_template} does not exist")
    if not Path(args.model).exists():
        raise UserError(f"MODEL: {args.model} does not exist")
    key = args.api_key or os.environ.get("LMFORGE_API_KEY")
    name = args.name or Path(args.model).resolve().name
    return ServerOptions(
        model=str(Path(args.model).resolve()),
        name=name,
        batching=args.batching,
        max_running=args.max_running,
        max_waiting=args.max_waiting,
        max_n=args.max_n,
        cache_size=args.cache_size,
        api_key_sha256=key_digest(key) if key else None,
        device=args.device,
        tokenizer=args.tokenizer,
        threads=args.threads,
        chat_template=str(Path(args.chat_template).resolve()) if args.chat_template else None,
    )


def _cmd_serve(args) -> int:
    options = _serve_options(args)
    from lmforge.ray_runtime import embedded_resources
    from lmforge.serve.app import check_cpus, check_model, check_port, serve_model

    check_port(args.host, args.port, args.address)
    embedded = embedded_resources(args.address)  # what a cluster this command starts would have
    check_cpus(args.cpus_per_replica, embedded["CPU"] if embedded else None)
    check_model(args.model, args.tokenizer)  # as the user typed it, for messages
    replicas = args.replicas if args.replicas == "auto" else int(args.replicas)
    serve_model(
        options,
        args.host,
        args.port,
        replicas,
        args.cpus_per_replica,
        args.address,
        args.route_prefix,
        args.app_name or options.name,
        say=lambda line: print(line, file=sys.stderr, flush=True),
    )
    return 0


def _cmd_eval(args) -> int:
    from lmforge.evaluation.judge import JudgeOptions, run_judge

    opts = JudgeOptions(
        a=args.a,
        b=args.b,
        judge=args.judge,
        prompts=args.prompts,
        out=args.out,
        max_tokens=args.max_tokens,
        judge_max_tokens=args.judge_max_tokens,
        concurrency=args.concurrency,
        keys={
            "a": args.a_key or os.environ.get("LMFORGE_JUDGE_A_KEY"),
            "b": args.b_key or os.environ.get("LMFORGE_JUDGE_B_KEY"),
            "judge": args.judge_key or os.environ.get("OPENAI_API_KEY"),
        },
        tracking_uri=args.tracking_uri,
        tracking=not args.no_tracking,
    )
    report = run_judge(opts, say=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    rates = report["rates"]
    print(
        f"judged {report['prompts']} prompts in both orders: A wins {rates['win']:.1%}, loses {rates['loss']:.1%}, "
        f"ties {rates['tie']:.1%}, inconsistent {rates['inconsistent']:.1%} ({report['unparsable']} unparsable verdicts) -> {args.out}"
    )
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
        commands = {
            "data": _cmd_prepare,
            "distill": _cmd_distill,
            "eval": _cmd_eval,
            "export": _cmd_export,
            "generate": _cmd_generate,
            "plan": _cmd_plan,
            "quantize": _cmd_quantize,
            "serve": _cmd_serve,
            "train": _cmd_train,
        }
        if args.command in JOB_COMMANDS:
            from lmforge.jobs.commands import run

            return run(args)
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
