"""Routing by prompt length under mixed load: short chat-sized requests and long
prompts (distinct, so no prefix is reused) sent together, against two replicas of one
model behind Serve's default routing ("plain") and against a short and a long replica
behind lmforge's length router ("routed", `--long-prompt-tokens`). Both applications
run on one Ray Serve; the sides alternate, one loaded at a time, and repeats go on
until the ratio's spread is under its distance from the target.

Target: the short requests' p99 latency at least 1.5x lower routed than plain.

    python bench/routing.py [--long-tokens 1500] [--short 32] [--long 8] [--max-repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from lmforge.models.config import PRESETS
from seeded_model import seeded_model

TARGET = 1.5
SIDES = ("plain", "routed")


def model_dir(tmp: Path, context: int) -> Path:
    return seeded_model(tmp / "model", PRESETS["small"].with_overrides(max_seq_len=context))


def deploy(model: Path, threshold: int) -> int:
    import ray
    from ray import serve

    from lmforge.serve.app import application
    from lmforge.serve.options import ServerOptions

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    plain = ServerOptions(model=str(model), name="model", max_running=8, cache_size=0, device="cpu")
    routed = ServerOptions(model=str(model), name="model", max_running=8, cache_size=0, device="cpu", long_prompt_tokens=threshold)
    serve.run(application(plain, 2, 0.5, 0.0), name="plain", route_prefix="/plain", blocking=False)
    serve.run(application(routed, 1, 0.5, 0.0), name="routed", route_prefix="/routed", blocking=False)
    return port


async def mixed_load(url: str, shorts: int, longs: int, long_tokens: int, rng: random.Random) -> dict:
    """Short requests at concurrency 4 while long ones arrive at concurrency 2: each
    kind's latencies (seconds) and errors."""
    import httpx2 as httpx  # the HTTP client the openai package is built on

    latencies: dict[str, list[float]] = {"short": [], "long": []}
    errors: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(kind: str, body: dict, limit: asyncio.Semaphore):
            async with limit:
                began = time.perf_counter()
                reply = await client.post("/v1/completions", json=body)
                if reply.status_code != 200:
                    errors.append(f"{reply.status_code} {reply.text[:200]}")
                latencies[kind].append(time.perf_counter() - began)

        short_limit, long_limit = asyncio.Semaphore(4), asyncio.Semaphore(2)
        short = {"model": "model", "prompt": "def main(args):\n    ", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        jobs = [one("short", short | {"seed": i}, short_limit) for i in range(shorts)]
        for _ in range(longs):
            prompt = [rng.randrange(1, 1000) for _ in range(long_tokens)]
            jobs.append(one("long", {"model": "model", "prompt": prompt, "max_tokens": 1, "temperature": 0}, long_limit))
        await asyncio.gather(*jobs)
    return {"latencies": latencies, "errors": errors}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--short", type=int, default=32, help="short requests per repeat per side")
    parser.add_argument("--long", type=int, default=8, help="long requests per repeat per side")
    parser.add_argument("--max-repeats", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp_dir:
        model = model_dir(Path(tmp_dir), args.long_tokens + 64)
        port = deploy(model, threshold=args.long_tokens // 2)
        import httpx2 as httpx

        for side in SIDES:  # up, and warm
            while httpx.get(f"http://127.0.0.1:{port}/{side}/health").status_code != 200:
                time.sleep(0.5)
            asyncio.run(mixed_load(f"http://127.0.0.1:{port}/{side}", 4, 2, args.long_tokens, rng))
        p99: dict[str, list[float]] = {side: [] for side in SIDES}
        p50: dict[str, list[float]] = {side: [] for side in SIDES}
        ratios, errors = [], 0
        for repeat in range(args.max_repeats):
            for side in SIDES if repeat % 2 == 0 else reversed(SIDES):
                done = asyncio.run(mixed_load(f"http://127.0.0.1:{port}/{side}", args.short, args.long, args.long_tokens, rng))
                errors += len(done["errors"])
                p99[side].append(quantile(done["latencies"]["short"], 0.99))
                p50[side].append(quantile(done["latencies"]["short"], 0.5))
            ratios.append(p99["plain"][-1] / p99["routed"][-1])
            print(
                f"repeat {repeat + 1}: short p50/p99 plain {p50['plain'][-1] * 1e3:.0f}/{p99['plain'][-1] * 1e3:.0f} ms, "
                f"routed {p50['routed'][-1] * 1e3:.0f}/{p99['routed'][-1] * 1e3:.0f} ms; p99 plain / routed {ratios[-1]:.2f}x",
                flush=True,
            )
            if len(ratios) >= 3 and max(ratios) - min(ratios) < abs(statistics.median(ratios) - TARGET):
                break
        median = statistics.median(ratios)
        print(
            f"\nshort requests (8 tokens) beside {args.long}x {args.long_tokens}-token prompts, {args.short} per repeat: "
            f"p50 plain {statistics.median(p50['plain']) * 1e3:.0f} ms, routed {statistics.median(p50['routed']) * 1e3:.0f} ms; "
            f"p99 plain / routed {median:.2f}x (repeats {', '.join(f'{r:.2f}' for r in ratios)}), "
            f"target >= {TARGET}: {'met' if median >= TARGET else 'NOT met'}; errors {errors}"
        )


if __name__ == "__main__":
    main()
