"""`lmforge serve | eval judge`: a model behind an OpenAI-compatible API, and two
models' answers judged by a third."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from lmforge.cli import common
from lmforge.errors import UserError
from lmforge.serve.options import ServerOptions, key_digest
from lmforge.sizes import parse_size


def add_parsers(sub) -> None:
    srv = sub.add_parser("serve", help="serve a model with an OpenAI-compatible API on Ray Serve (continuous batching)")
    srv.add_argument("model", help="an lmforge export, a quantized directory, a Hugging Face Llama directory or a committed step directory")
    srv.add_argument("--name", help="the model's name in requests and /v1/models (default: the directory's name)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--grpc-port", type=int, help="also serve lmforge.v1.Completions over gRPC on this port (default: HTTP only)")
    srv.add_argument("--replicas", default="1", help="replicas of the model, or auto (Serve scales 1..--max-replicas on load)")
    srv.add_argument("--max-replicas", type=int, default=4, help="--replicas auto: the most replicas (default 4)")
    srv.add_argument("--batching", default="continuous", help="continuous (default), request (Ray Serve's @serve.batch) or off")
    srv.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="streamed tokens per chunk and running choice (default 1; the first token goes at once): "
        "larger sends fewer chunks through Serve's proxy, more tokens/s under load",
    )
    srv.add_argument(
        "--backend",
        default="torch",
        help="torch (lmforge's model, default) or onnxruntime (a directory made by lmforge export --format onnx; pip install 'lmforge[onnx]')",
    )
    srv.add_argument(
        "--adapter",
        dest="adapters",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also serve a LoRA adapter (a PEFT directory, e.g. from lmforge export --format peft) as model NAME; repeat for more",
    )
    srv.add_argument("--max-running", type=int, default=16, help="sequences decoding together per replica (default 16)")
    srv.add_argument(
        "--memory-per-replica",
        help='memory a replica may use ("24GiB": its GPU\'s, or on CPU what it may take): --max-running is lowered to the '
        "full-context sequences that fit beside the weights, and a replica that cannot hold one is refused",
    )
    srv.add_argument("--max-waiting", type=int, default=256, help="sequences queued per replica before 503 (default 256)")
    srv.add_argument("--max-n", type=int, default=8, help="the largest n a request may ask for (default 8)")
    srv.add_argument("--max-logprobs", type=int, default=20, help="the most top alternatives per token a request may ask for (default 20, as vLLM's)")
    srv.add_argument(
        "--no-prefix-reuse",
        dest="prefix_reuse",
        action="store_false",
        help="compute every prompt whole (default: a beginning a replica holds from an earlier prompt is reused)",
    )
    srv.add_argument(
        "--long-prompt-tokens",
        type=int,
        help="route prompts of this many tokens or more to replicas of their own (default: no routing by length)",
    )
    srv.add_argument("--long-replicas", type=int, default=1, help="with --long-prompt-tokens: replicas for the long prompts (default 1)")
    srv.add_argument("--cache-size", type=int, default=256, help="temperature-0 responses kept for identical requests (0: none)")
    srv.add_argument("--api-key", help="require Authorization: Bearer KEY on /v1 (default: LMFORGE_API_KEY, else none)")
    srv.add_argument("--route-prefix", default="/", help="URL prefix of this model's routes (several models on one cluster)")
    srv.add_argument("--app-name", help="Serve application name (default: --name)")
    srv.add_argument("--chat-template", help="Jinja chat template file (default: the model's tokenizer_config.json, else lmforge's)")
    srv.add_argument("--tokenizer", help="tokenizer.json (default: the model's, or its dataset's)")
    srv.add_argument("--device", help="cpu or cuda (default: cuda when the cluster has GPUs; each replica then asks for one)")
    srv.add_argument("--cpus-per-replica", type=float, default=1.0)
    srv.add_argument("--threads", type=int, default=1, help="torch threads per replica (default 1)")
    common.add_cluster(srv, progress=False)
    srv.set_defaults(run=serve_command)

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
    common.add_tracking(judge)
    common.add_json(judge, "the report")
    judge.set_defaults(run=judge_command)

    harness = evaluate.add_parser(
        "harness", help="lm-evaluation-harness tasks on a model or checkpoint, in this process or on a tp x pp layout (pip install 'lmforge[eval]')"
    )
    harness.add_argument("model", help="a committed checkpoint, an lmforge export, a Hugging Face or a quantized directory")
    harness.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    harness.add_argument("--include-path", help="a directory of task YAML files (and their data) beside lm-eval's own")
    harness.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt (default: each task's)")
    harness.add_argument("--limit", type=float, help="at most this many documents per task (or a fraction, below 1)")
    harness.add_argument("--batch-size", type=int, default=8, help="sequences scored per forward (default 8)")
    harness.add_argument("--out", help="directory for lm-eval's results_*.json and samples_*.jsonl")
    harness.add_argument("--seed", type=int, default=0)
    harness.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="the layout: parallel.tp=N, parallel.pp=N (more than one rank: on the Ray cluster)",
    )
    common.add_cluster(harness, progress=False)
    common.add_tracking(harness)
    common.add_json(harness, "the report")
    harness.set_defaults(run=harness_command)


def _adapters(given: list[str]) -> dict[str, str]:
    adapters: dict[str, str] = {}
    for item in given:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--adapter: expected NAME=DIR, got {item!r}")
        if name in adapters:
            raise UserError(f"--adapter: {name} is given twice")
        adapters[name] = str(Path(path).resolve())
    return adapters


def _size(flag: str, text: Optional[str]) -> Optional[int]:
    try:
        return None if text is None else parse_size(text)
    except ValueError as err:
        raise UserError(f"{flag}: {err}") from None


def serve_command(args) -> int:
    key = args.api_key or os.environ.get("LMFORGE_API_KEY")
    model = Path(args.model).resolve()
    options = ServerOptions(
        model=str(model),
        name=args.name or model.name,
        batching=args.batching,
        backend=args.backend,
        stream_interval=args.stream_interval,
        adapters=_adapters(args.adapters),
        max_running=args.max_running,
        max_waiting=args.max_waiting,
        max_n=args.max_n,
        max_logprobs=args.max_logprobs,
        prefix_reuse=args.prefix_reuse,
        long_prompt_tokens=args.long_prompt_tokens,
        long_replicas=args.long_replicas,
        cache_size=args.cache_size,
        api_key_sha256=key_digest(key) if key else None,
        device=args.device,
        tokenizer=args.tokenizer,
        threads=args.threads,
        chat_template=str(Path(args.chat_template).resolve()) if args.chat_template else None,
        memory_per_replica=_size("--memory-per-replica", args.memory_per_replica),
    )
    common.sdk().serve(
        options,
        args.host,
        args.port,
        args.replicas if args.replicas == "auto" or not args.replicas.isdigit() else int(args.replicas),
        max_replicas=args.max_replicas,
        cpus_per_replica=args.cpus_per_replica,
        address=args.address,
        route_prefix=args.route_prefix,
        app_name=args.app_name or options.name,
        say=common.say,
        model_as_given=args.model,
        grpc_port=args.grpc_port,
    )
    return 0


def harness_command(args) -> int:
    report = common.sdk().evaluate_harness(
        args.model,
        [task.strip() for task in args.tasks.split(",") if task.strip()],
        include_path=args.include_path,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        batch_size=args.batch_size,
        out=args.out,
        seed=args.seed,
        tracking=not args.no_tracking,
        tracking_uri=args.tracking_uri,
        address=args.address,
        say=common.say,
        **harness_layout(args.overrides),
    )
    if args.json:
        return common.print_json(report.model_dump(), args.stdout)
    for task, metrics in report.results.items():
        common.say(f"{task}: " + ", ".join(f"{name} {value:.4g}" for name, value in sorted(metrics.items())))
    return 0


HARNESS_LAYOUT = ("parallel.tp", "parallel.pp")


def harness_layout(overrides: list[str]) -> dict[str, int]:
    """`--set parallel.tp=2` and the like, as `evaluate_harness`'s tp and pp."""
    layout = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() not in HARNESS_LAYOUT:
            raise UserError(f"--set {item}: eval harness takes {' and '.join(HARNESS_LAYOUT)} (KEY=VALUE)")
        if not value.strip().isdigit():
            raise UserError(f"--set {key.strip()}: a whole number of ranks, got {value.strip()!r}")
        layout[key.strip().removeprefix("parallel.")] = int(value)
    return layout


def judge_command(args) -> int:
    report = common.sdk().judge(
        args.a,
        args.b,
        args.judge,
        args.prompts,
        args.out,
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
        say=common.say,
    )
    if args.json:
        return common.print_json(report, args.stdout)
    rates = report["rates"]
    print(
        f"judged {report['prompts']} prompts in both orders: A wins {rates['win']:.1%}, loses {rates['loss']:.1%}, "
        f"ties {rates['tie']:.1%}, inconsistent {rates['inconsistent']:.1%} ({report['unparsable']} unparsable verdicts) -> {args.out}"
    )
    return 0
