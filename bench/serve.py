"""Serving under load: a bounded load generator on loopback against `lmforge serve`'s
application with continuous, request-level (`@serve.batch`) and no batching, and an
int8 quantization of the same model with continuous batching, all deployed at once
on one Ray Serve. For each concurrency, each side gets the same fixed number of
streamed requests (the `openai` client, greedy: every side generates the same tokens,
up to `--max-tokens` or an end of text; the response cache is off): output tokens/s
(counted from each answer's usage), time to first token
and end-to-end latency p50/p99, errors. Sides alternate within each repeat, repeats
go on until each target ratio's spread is smaller than its distance from the target
(at most `--max-repeats`, within `--time-limit`), since machines here are shared.

`stream4` is continuous batching with `--stream-interval 4` (each chunk holds 4 new
tokens of every running choice, the first token goes at once). A peer runs in the same repeats: `transformers serve --continuous-batching` (its own
process, one thread, fp32 on CPU) on the same model exported to Hugging Face format,
with the same prompts and loads.

Targets: continuous >= 3x no batching in tokens/s at concurrency 8; at concurrency 1,
continuous adds <= 10% to TTFT p50; continuous (and stream4) >= 1.5x transformers
serve's tokens/s at concurrency 8, and no worse TTFT p50 at 1; zero errors.

`--direct-ingress` sets Ray Serve's experimental `RAY_SERVE_ENABLE_DIRECT_INGRESS=1`
for the cluster it starts: no proxies, the clients connect to each side's replica.

    python bench/serve.py [--model DIR] [--max-tokens 32] [--concurrency 1,8,32] [--max-repeats 6] [--sides continuous,stream4,...] [--direct-ingress]

The model defaults to the newest checkpoint of `runs/quickstart` (exported), else the
`small` preset with seeded weights.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from lmforge.models.config import PRESETS
from seeded_model import seeded_model

# stream4: continuous batching with --stream-interval 4 (a chunk per 4 tokens of each
# running choice, the first at once): fewer chunks through Serve's proxy.
SIDES = ("continuous", "stream4", "request", "off", "int8", "transformers")
LMFORGE_SIDES = SIDES[:5]  # the peer runs in its own process
TARGETS = {
    "continuous / off tok/s @8": (3.0, "min"),
    "continuous / off TTFT p50 @1": (1.10, "max"),
    "stream4 / off tok/s @8": (3.0, "min"),
    "continuous / transformers tok/s @8": (1.5, "min"),
    "continuous / transformers TTFT p50 @1": (1.0, "max"),
    "stream4 / transformers tok/s @8": (1.5, "min"),
    "stream4 / transformers TTFT p50 @1": (1.0, "max"),
}


def model_dir(args, tmp: Path) -> Path:
    from lmforge.checkpoint.export import export_model

    if args.model:
        return Path(args.model)
    steps = sorted(Path("runs/quickstart/checkpoints").glob("step_*"))
    out = tmp / "fp32"
    if steps:
        export_model(steps[-1], out)
        return out
    return seeded_model(out, PRESETS["small"])


def int8_dir(source_dir: Path, tmp: Path) -> Path:
    from lmforge.checkpoint.export import open_source
    from lmforge.models.build import build_model
    from lmforge.models.quantized import quantize_blocks, write_quantized

    source = open_source(source_dir)
    model = build_model(source.cfg, weights=source.read_tensors())
    quantize_blocks(model, "int8", 0)
    write_quantized(tmp / "int8", source, model, "int8", 0)
    return tmp / "int8"


def prompts(count: int) -> list[str]:
    """Real text of varied lengths: slices of standard-library sources."""
    from lmforge.data.corpus import stdlib_files

    texts = [text for text in (Path(f).read_text(errors="replace") for f in stdlib_files()[:200]) if len(text) > 1000][:64]
    return [texts[i % len(texts)][(37 * i) % 500 :][: 60 + (29 * i) % 140] for i in range(count)]


async def load(url: str, texts: list[str], concurrency: int, max_tokens: int, model: str = "model") -> dict:
    """Each text once, at most `concurrency` in flight."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
    limit = asyncio.Semaphore(concurrency)
    ttfts, e2es, tokens, errors = [], [], [], []

    async def one(text: str):
        async with limit:
            began = time.perf_counter()
            first = None
            try:
                stream = await client.completions.create(
                    model=model,
                    prompt=text,
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text and first is None:
                        first = time.perf_counter() - began
                    if chunk.usage:
                        tokens.append(chunk.usage.completion_tokens)
                ttfts.append(first if first is not None else time.perf_counter() - began)
                e2es.append(time.perf_counter() - began)
            except Exception as err:  # noqa: BLE001 - counted, the load goes on
                errors.append(f"{type(err).__name__}: {err}")

    began = time.perf_counter()
    await asyncio.gather(*(one(t) for t in texts))
    wall = time.perf_counter() - began
    await client.close()
    return {
        "tok_s": sum(tokens) / wall,
        "ttft_p50": pct(ttfts, 50),
        "ttft_p99": pct(ttfts, 99),
        "e2e_p50": pct(e2es, 50),
        "e2e_p99": pct(e2es, 99),
        "errors": len(errors),
        "error_samples": errors[:2],
    }


def pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def deploy(model: Path, int8: Path, max_running: int, sides: tuple[str, ...], direct: bool = False) -> dict[str, str]:
    """lmforge's sides on one Ray Serve: each side's base URL. `direct`: Ray Serve's
    experimental direct ingress (each ingress replica listens itself, no proxy)."""
    import ray
    from ray import serve

    from lmforge.serve.app import application
    from lmforge.serve.options import ServerOptions

    if direct:  # read by the Serve controller and replicas, which inherit this environment
        os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    urls = {}
    for side in (side for side in sides if side in LMFORGE_SIDES):
        options = ServerOptions(
            model=str(int8 if side == "int8" else model),
            name="model",
            batching="continuous" if side in ("int8", "stream4") else side,
            max_running=max_running,
            cache_size=0,
            device="cpu",
            stream_interval=4 if side == "stream4" else 1,
        )
        serve.run(application(options, 1, 0.5, 0.0), name=side, route_prefix=f"/{side}", blocking=False)
        urls[side] = f"http://127.0.0.1:{_replica_port(side) if direct else port}/{side}/v1"
    return urls


def _replica_port(side: str) -> int:
    """The port Serve gave the side's replica (direct ingress allocates from 30000)."""
    import httpx2 as httpx

    for port in range(30000, 31000):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/{side}/health", timeout=1).status_code == 200:
                return port
        except httpx.HTTPError:
            continue
    raise RuntimeError(f"no replica of {side} answers on ports 30000-30999")


def peer(model: Path, tmp: Path) -> tuple[subprocess.Popen, int, str]:
    """`transformers serve --continuous-batching` on the model's Hugging Face export, up
    and warm: (its process, port, the model name its requests carry)."""
    import httpx2 as httpx

    from lmforge.checkpoint.export import export_model

    hf = tmp / "hf"
    export_model(model, hf, "hf")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        str(Path(sys.executable).with_name("transformers")),
        "serve",
        str(hf),
        "--continuous-batching",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--port",
        str(port),
    ]
    process = subprocess.Popen(command, env=os.environ | {"OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(1)
    asyncio.run(load(f"http://127.0.0.1:{port}/v1", prompts(2), 1, 4, str(hf)))  # its first request loads the model
    return process, port, str(hf)


def engine_alone(model: Path, slots: int, sequences: int, max_tokens: int) -> float:
    """Tokens/s of the continuous engine in this process, no HTTP: `sequences` greedy
    prompts submitted at once to an engine of `slots` slots."""
    import threading

    import torch

    from lmforge.inference.generate import Generator
    from lmforge.inference.sampling import SamplingParams
    from lmforge.serve.engine import ContinuousBatcher, Sequence

    torch.set_num_threads(1)
    generator = Generator.load(str(model))
    engine = ContinuousBatcher(generator.model, frozenset(), generator.tokenizer.get_vocab_size(), slots)
    done, params = threading.Semaphore(0), SamplingParams(max_new_tokens=max_tokens, temperature=0, stop_at_eos=False)
    encoded = [generator.tokenizer.encode(text).ids for text in prompts(sequences)]
    began = time.perf_counter()
    for ids in encoded:
        engine.submit(Sequence(ids, params, lambda token: token.finish_reason and done.release()))
    for _ in range(sequences):
        done.acquire()
    return sequences * max_tokens / (time.perf_counter() - began)


RATIOS = {
    "continuous / off tok/s @8": ("continuous", "off", 8, "tok_s"),
    "continuous / off TTFT p50 @1": ("continuous", "off", 1, "ttft_p50"),
    "stream4 / off tok/s @8": ("stream4", "off", 8, "tok_s"),
    "continuous / transformers tok/s @8": ("continuous", "transformers", 8, "tok_s"),
    "continuous / transformers TTFT p50 @1": ("continuous", "transformers", 1, "ttft_p50"),
    "stream4 / transformers tok/s @8": ("stream4", "transformers", 8, "tok_s"),
    "stream4 / transformers TTFT p50 @1": ("stream4", "transformers", 1, "ttft_p50"),
}


def settled(history: dict[str, list[float]]) -> bool:
    """Every ratio this run measures: three repeats, spread smaller than its distance from the target."""
    for name, values in history.items():
        target = TARGETS[name][0]
        if len(values) < 3:
            return False
        spread = max(values) - min(values)
        if spread >= abs(statistics.median(values) - target):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-running", type=int, default=32, help="continuous and request batching: sequences per step")
    parser.add_argument("--max-repeats", type=int, default=6)
    parser.add_argument("--time-limit", type=float, default=900, help="seconds; no new repeat starts after it")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"which of {', '.join(SIDES)} to run")
    parser.add_argument("--rounds", type=int, default=2, help="requests per cell: this many times the concurrency (more: less noise)")
    parser.add_argument("--direct-ingress", action="store_true", help="Ray Serve's experimental direct ingress: clients reach the replicas, no proxy")
    args = parser.parse_args()
    sides = tuple(side for side in SIDES if side in args.sides.split(","))
    levels = [int(c) for c in args.concurrency.split(",")]
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = model_dir(args, tmp)
        urls = deploy(model, int8_dir(model, tmp) if "int8" in sides else model, args.max_running, sides, args.direct_ingress)
        process, peer_port, peer_model = peer(model, tmp) if "transformers" in sides else (None, 0, "")
        cells: dict[tuple[int, str], list[dict]] = {}
        history: dict[str, list[float]] = {}
        engine: list[float] = []
        for repeat in range(args.max_repeats):
            for concurrency in levels:
                texts = prompts(max(8, args.rounds * concurrency))
                order = sides if repeat % 2 == 0 else tuple(reversed(sides))
                for side in order:
                    url, name = (f"http://127.0.0.1:{peer_port}/v1", peer_model) if side == "transformers" else (urls[side], "model")
                    cells.setdefault((concurrency, side), []).append(asyncio.run(load(url, texts, concurrency, args.max_tokens, name)))
            last = {key: runs[-1] for key, runs in cells.items()}
            for name, (a, b, concurrency, key) in RATIOS.items():
                if concurrency in levels and a in sides and b in sides:
                    history.setdefault(name, []).append(last[(concurrency, a)][key] / last[(concurrency, b)][key])
            # The same batching without HTTP, Serve or a client: where the rest of the time goes.
            engine.append(engine_alone(model, 8, 8, args.max_tokens) / engine_alone(model, 1, 8, args.max_tokens))
            print(f"repeat {repeat + 1}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in history.items()), flush=True)
            if settled(history) or time.time() - started > args.time_limit:
                break
        if process is not None:
            process.terminate()
            process.wait(30)
        report(cells, history, model, args)
        print(
            f"engine alone (no HTTP), 8 sequences: 8 slots / 1 slot {statistics.median(engine):.2f}x tok/s "
            f"(repeats {', '.join(f'{v:.2f}' for v in engine)})"
        )


def report(cells, history, model, args) -> None:
    print(f"\nmodel {model}, {args.max_tokens} tokens per answer, medians of {len(next(iter(cells.values())))} repeats")
    print(f"{'conc':>4} {'side':<11} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'e2e p50':>8} {'e2e p99':>8} {'errors':>6}")
    errors = 0
    for (concurrency, side), runs in sorted(cells.items(), key=lambda kv: (kv[0][0], SIDES.index(kv[0][1]))):
        med = {key: statistics.median(r[key] for r in runs) for key in ("tok_s", "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")}
        count = sum(r["errors"] for r in runs)
        errors += count
        print(
            f"{concurrency:>4} {side:<11} {med['tok_s']:>8.1f} {med['ttft_p50'] * 1e3:>7.1f}ms {med['ttft_p99'] * 1e3:>7.1f}ms "
            f"{med['e2e_p50']:>7.3f}s {med['e2e_p99']:>7.3f}s {count:>6}"
        )
        for sample in (s for r in runs for s in r["error_samples"]):
            print(f"     error: {sample}")
    for name, values in history.items():
        target, kind = TARGETS[name]
        median = statistics.median(values)
        met = median >= target if kind == "min" else median <= target
        print(
            f"{name}: {median:.3f} (repeats {', '.join(f'{v:.3f}' for v in values)}; spread {max(values) - min(values):.3f}), "
            f"target {'>=' if kind == 'min' else '<='} {target}: {'met' if met else 'NOT met'}"
        )
    pairs = [("continuous", "off"), ("request", "off"), ("continuous", "request"), ("int8", "continuous"), ("stream4", "continuous")]
    pairs += [("continuous", "transformers"), ("stream4", "transformers")]
    for concurrency in sorted({c for c, _ in cells}):
        tok_s = {side: statistics.median(r["tok_s"] for r in runs) for (c, side), runs in cells.items() if c == concurrency}
        shown = [f"{a} / {b} {tok_s[a] / tok_s[b]:.2f}x" for a, b in pairs if a in tok_s and b in tok_s]
        print(f"@{concurrency} tok/s: " + ", ".join(shown))
    print(f"errors: {errors} (target 0)")


if __name__ == "__main__":
    main()
