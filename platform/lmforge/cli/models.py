"""`lmforge export | generate | quantize`: models out of checkpoints, text out of
models, and smaller models."""

from __future__ import annotations

import json

from lmforge.cli import common

GENERATE_FLAGS = {
    key: "--" + key.replace("_", "-") for key in ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "stop", "prompt")
}
SAMPLING = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "stop")


def add_parsers(sub) -> None:
    export = sub.add_parser("export", help="write a model directory (config.json, model.safetensors, tokenizer) from a checkpoint")
    export.add_argument(
        "checkpoint",
        help="a committed step directory (e.g. runs/NAME/checkpoints/step_00000100), an lmforge export or a Hugging Face Llama directory",
    )
    export.add_argument("--out", required=True, help="new directory to write (usable as model.init_from)")
    export.add_argument(
        "--format",
        default="lmforge",
        help="lmforge (default), hf (a directory transformers loads with no custom code), onnx (onnxruntime-genai's, for CPU) "
        "or peft (a LoRA job's adapters alone, for peft on the Hugging Face export of its base)",
    )
    export.add_argument("--dtype", default="fp32", help="fp32 (default), bf16 or fp16; with --format onnx: fp32 or int4")
    export.add_argument("--tokenizer", help="tokenizer.json to ship (default: the dataset's the checkpoint was trained on)")
    export.add_argument(
        "--register",
        action="store_true",
        help="log the export to the checkpoint's MLflow run and register it as a model version (default: neither)",
    )
    export.set_defaults(run=export_command)

    gen = sub.add_parser("generate", help="generate text from a model: a checkpoint, an lmforge export, a Hugging Face or a quantized directory")
    gen.add_argument("model", help="a committed step directory, an lmforge export, a Hugging Face Llama directory or a quantized directory")
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
    gen.add_argument("--backend", default="torch", help="torch (default) or onnxruntime (a directory lmforge export --format onnx wrote)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt: text, tokens, logprobs, finish_reason")
    gen.set_defaults(run=generate_command)

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
    common.add_tracking(quant)
    common.add_json(quant, "the report")
    quant.set_defaults(run=quantize_command)


def export_command(args) -> int:
    result = common.sdk().export(args.checkpoint, args.out, format=args.format, dtype=args.dtype, tokenizer=args.tokenizer, register=args.register)
    what = f"step {result.step}" if result.step is not None else f"a {result.source_kind} model"
    common.say(
        f"exported {what} as {result.format} {args.dtype} ({result.parameters:,} parameters"
        f"{', with its tokenizer' if result.tokenizer else ', no tokenizer'}) -> {result.out}"
    )
    if result.registered:
        registered = result.registered
        common.say(f"registered in MLflow as {registered.name} version {registered.version} (run {registered.run_id})")
    return 0


def generate_command(args) -> int:
    sampling = {key: getattr(args, key) for key in SAMPLING}
    results = common.sdk().generate(
        args.model,
        args.prompt,
        device=args.device,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        names=GENERATE_FLAGS,
        backend=args.backend,
        **sampling,
    )
    for prompt, result in zip(args.prompt, results):
        if args.json:
            print(json.dumps({"prompt": prompt} | result), file=args.stdout)
        else:
            print(prompt + result["text"])
            common.say(f"[{len(result['tokens'])} tokens, {result['finish_reason']}]")
    return 0


def quantize_command(args) -> int:
    report = common.sdk().quantize(
        args.model,
        args.method,
        args.out,
        group_size=args.group_size,
        eval_data=args.eval_data,
        eval_samples=args.eval_samples,
        tokenizer=args.tokenizer,
        tracking_uri=args.tracking_uri,
        tracking=not args.no_tracking,
        say=common.say,
    )
    if args.json:
        return common.print_json(report, args.stdout)
    lines = [
        f"quantized {args.model} to {report['method']}" + (f" (group {report['group_size']})" if report["group_size"] else "") + f" -> {args.out}",
        f"  with          : {report['library']}",
        f"  Linear weights: {report['linear_bytes']:,} bytes, {report['linear_ratio_vs_bf16']:.3f}x bf16 ({report['linear_bytes_bf16']:,})",
        f"  whole model   : {report['model_bytes']:,} bytes, {report['model_ratio_vs_bf16']:.3f}x bf16 ({report['model_bytes_bf16']:,})",
        f"  perplexity    : {report['quantized_perplexity']:.4f} against {report['source_perplexity']:.4f} unquantized "
        f"({100 * (report['perplexity_ratio'] - 1):+.2f}%), {report['eval_samples']} held-out samples of {report['eval_data']}",
        *([f"  MLflow run    : {report['mlflow_run_id']} ({report['mlflow_tracking_uri']})"] if report.get("mlflow_run_id") else []),
    ]
    print("\n".join(lines))
    return 0
