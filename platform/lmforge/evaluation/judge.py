"""`lmforge eval judge`: pairwise LLM-as-judge over OpenAI-compatible endpoints (A and B
may also be model directories, answered in this process). A and B answer each prompt;
the judge sees every pair twice, in both orders (MT-Bench's pairwise prompt, verdicts
[[A]], [[B]] or [[C]] for a tie). Two verdicts that agree decide the prompt; two that
disagree make it inconsistent (position bias); a verdict that cannot be parsed, or an
endpoint's error, is counted, never a crash.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lmforge.chat import chat_renderer, chat_template_of
from lmforge.credentials import redact_uri
from lmforge.errors import UserError
from lmforge.tracking.command_run import log_command_run, tracking_uri

JUDGE_SYSTEM = (
    "Please act as an impartial judge and evaluate the quality of the responses provided by two AI assistants to the "
    "user question displayed below. Choose the assistant that follows the user's instructions and answers the question "
    "better, considering helpfulness, relevance, accuracy, depth and level of detail. Avoid any position bias: the order "
    "in which the responses were presented must not influence your decision, nor their length, nor the assistants' names. "
    "Be as objective as possible. After a short explanation, output your final verdict by strictly following this format: "
    '"[[A]]" if assistant A is better, "[[B]]" if assistant B is better, and "[[C]]" for a tie.'
)
JUDGE_USER = (
    "[User Question]\n{question}\n\n[The Start of Assistant A's Answer]\n{answer_a}\n[The End of Assistant A's Answer]\n\n"
    "[The Start of Assistant B's Answer]\n{answer_b}\n[The End of Assistant B's Answer]"
)
OUTCOMES = ("win", "loss", "tie", "inconsistent", "unparsable", "error")  # of A against B


@dataclass
class JudgeOptions:
    a: str
    b: str
    judge: str
    prompts: str
    out: str
    max_tokens: int = 256
    judge_max_tokens: int = 512
    concurrency: int = 8
    keys: dict[str, Optional[str]] = field(default_factory=dict)  # endpoint (a, b, judge) -> its own API key
    tracking_uri: Optional[str] = None
    tracking: bool = True


@dataclass
class Endpoint:
    flag: str
    base_url: str
    model: Optional[str]  # None: the first that /v1/models lists

    @classmethod
    def parse(cls, flag: str, value: str, local_allowed: bool) -> "Endpoint | LocalModel":
        url, _, model = value.partition("#")
        if local_allowed and not re.match(r"^https?://", value) and Path(value).exists():
            return LocalModel(flag, value)
        if not re.match(r"^https?://[^/\s]+", url):
            raise UserError(
                f"{flag}: {value!r} is not an OpenAI-compatible base URL (http://host:port/v1, optionally #model)"
                + (" or a model directory" if local_allowed else "")
            )
        return cls(flag, url.rstrip("/"), model or None)


class LocalModel:
    """--a or --b given as a model directory: answered greedily in this process."""

    def __init__(self, flag: str, path: str):
        from lmforge.inference.generate import Generator, default_device  # torch, for a local model only

        self.flag, self.base_url, self.model = flag, str(Path(path).resolve()), Path(path).resolve().name
        self.generator = Generator.load(path, default_device())
        self.render = chat_renderer(chat_template_of(path), "chat_template")
        self.lock = asyncio.Lock()  # one generation at a time on the model

    async def answer(self, messages: list[dict], max_tokens: int) -> str:
        from lmforge.inference.sampling import SamplingParams

        prompt = self.render(messages)
        room = self.generator.model.cfg.max_seq_len - len(self.generator.tokenizer.encode(prompt, add_special_tokens=False).ids)
        if room < 1:
            raise ValueError(f"the prompt fills the model's context of {self.generator.model.cfg.max_seq_len} tokens")
        params = SamplingParams(max_new_tokens=min(max_tokens, room), temperature=0)
        async with self.lock:
            return (await asyncio.to_thread(self.generator.generate, [prompt], params, None, True))[0].text


def parse_verdict(text: Optional[str]) -> Optional[str]:
    """'A', 'B' or 'C' (a tie): the last [[X]] in the judge's text, or a bare answer of
    just the letter; None when there is neither."""
    if not text:
        return None
    marks = re.findall(r"\[\[\s*([ABC])\s*\]\]", text)
    if marks:
        return marks[-1]
    bare = text.strip().strip(".\"'*").upper()
    return {"A": "A", "B": "B", "C": "C", "TIE": "C"}.get(bare)


def outcome(first: Optional[str], swapped: Optional[str]) -> str:
    """A's result from the verdict with A shown first and the one with A shown second."""
    if first is None or swapped is None:
        return "unparsable"
    swapped = {"A": "B", "B": "A", "C": "C"}[swapped]  # back to A's and B's names
    if first != swapped:
        return "inconsistent"
    return {"A": "win", "B": "loss", "C": "tie"}[first]


def read_prompts(path: str) -> list[dict]:
    """Each line {"prompt": str} or {"messages": [{role, content}, ...]}: as chat messages."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"--prompts: {path} does not exist")
    prompts = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise UserError(f"{path}:{number}: not JSON ({err})") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"]:
            prompts.append({"messages": [{"role": "user", "content": row["prompt"]}], "question": row["prompt"]})
        elif isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            question = next((m.get("content") for m in reversed(row["messages"]) if isinstance(m, dict) and m.get("role") == "user"), None)
            if not isinstance(question, str):
                raise UserError(f"{path}:{number}: messages without a user message")
            prompts.append({"messages": row["messages"], "question": question})
        else:
            raise UserError(f'{path}:{number}: expected {{"prompt": text}} or {{"messages": [...]}}')
    if not prompts:
        raise UserError(f"--prompts: {path} holds no prompts")
    return prompts


class Judging:
    """The clients, the concurrency bound and each call's failure turned into data."""

    def __init__(self, opts: JudgeOptions):
        from openai import AsyncOpenAI

        self.opts = opts
        self.endpoints = {name: Endpoint.parse(f"--{name}", getattr(opts, name), name != "judge") for name in ("a", "b", "judge")}
        # Each endpoint gets its own key: the judge is someone else's service, never sent A's or B's.
        self.clients = {
            name: AsyncOpenAI(base_url=e.base_url, api_key=opts.keys.get(name) or "none", max_retries=2, timeout=600)
            for name, e in self.endpoints.items()
            if isinstance(e, Endpoint)
        }
        self.limit = asyncio.Semaphore(opts.concurrency)

    async def resolve_models(self) -> None:
        for name, endpoint in self.endpoints.items():
            if isinstance(endpoint, Endpoint) and endpoint.model is None:
                try:
                    listed = await self.clients[name].models.list()
                except Exception as err:  # noqa: BLE001 - any client error is the user's endpoint
                    raise UserError(
                        f"{endpoint.flag}: {redact_uri(endpoint.base_url)} did not list its models ({type(err).__name__}: {err})"
                    ) from None
                if not listed.data:
                    raise UserError(f"{endpoint.flag}: {redact_uri(endpoint.base_url)} lists no models")
                endpoint.model = listed.data[0].id

    async def chat(self, name: str, messages: list[dict], max_tokens: int) -> tuple[Optional[str], Optional[str]]:
        """(the reply, None) or (None, the error)."""
        async with self.limit:
            try:
                if isinstance(self.endpoints[name], LocalModel):
                    return await self.endpoints[name].answer(messages, max_tokens), None
                reply = await self.clients[name].chat.completions.create(
                    model=self.endpoints[name].model, messages=messages, max_tokens=max_tokens, temperature=0
                )
                return reply.choices[0].message.content or "", None
            except Exception as err:  # noqa: BLE001 - recorded against the prompt
                return None, f"{type(err).__name__}: {err}"

    async def judge_one(self, index: int, prompt: dict) -> dict:
        (answer_a, error_a), (answer_b, error_b) = await asyncio.gather(
            self.chat("a", prompt["messages"], self.opts.max_tokens), self.chat("b", prompt["messages"], self.opts.max_tokens)
        )
        row = {"index": index, "question": prompt["question"], "answer_a": answer_a, "answer_b": answer_b}
        if error_a or error_b:
            return row | {"outcome": "error", "error": error_a or error_b}
        orders = {"a_first": (answer_a, answer_b), "b_first": (answer_b, answer_a)}
        replies = await asyncio.gather(
            *(
                self.chat(
                    "judge",
                    [
                        {"role": "system", "content": JUDGE_SYSTEM},
                        {"role": "user", "content": JUDGE_USER.format(question=prompt["question"], answer_a=first, answer_b=second)},
                    ],
                    self.opts.judge_max_tokens,
                )
                for first, second in orders.values()
            )
        )
        verdicts = {order: parse_verdict(text) for order, (text, _) in zip(orders, replies)}
        return row | {
            "judge_replies": {order: text for order, (text, _) in zip(orders, replies)},
            "judge_errors": {order: error for order, (_, error) in zip(orders, replies) if error},
            "verdicts": verdicts,
            "outcome": outcome(verdicts["a_first"], verdicts["b_first"]),
        }


def aggregate(rows: list[dict]) -> dict:
    counts = {name: sum(row["outcome"] == name for row in rows) for name in OUTCOMES}
    unparsable = sum(v is None for row in rows for v in row.get("verdicts", {}).values())
    return {"prompts": len(rows), "counts": counts, "rates": {name: n / len(rows) for name, n in counts.items()}, "unparsable": unparsable}


def run_judge(opts: JudgeOptions, say=print) -> dict:
    prompts = read_prompts(opts.prompts)
    out = Path(opts.out)
    if out.exists():
        raise UserError(f"--out: {out} already exists")
    if opts.concurrency < 1:
        raise UserError(f"--concurrency: must be at least 1, got {opts.concurrency}")
    rows, endpoints = asyncio.run(_judge_all(opts, prompts, say))
    report = {
        "a": endpoints["a"],
        "b": endpoints["b"],
        "judge": endpoints["judge"],
        "prompts_file": opts.prompts,
        **aggregate(rows),
        "per_prompt": rows,
    }
    staging = out.with_name(f".{out.name}.partial")
    staging.mkdir(parents=True, exist_ok=True)
    (staging / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (staging / "judgments.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    staging.rename(out)
    if opts.tracking:
        report["mlflow_run_id"] = _log(opts, report)
    return report


async def _judge_all(opts: JudgeOptions, prompts: list[dict], say) -> tuple[list[dict], dict]:
    judging = Judging(opts)
    await judging.resolve_models()
    endpoints = {name: f"{redact_uri(e.base_url)}#{e.model}" for name, e in judging.endpoints.items()}
    say(f"judging {len(prompts)} prompts: A {endpoints['a']} against B {endpoints['b']}, judge {endpoints['judge']}")
    tasks = [asyncio.ensure_future(judging.judge_one(i, p)) for i, p in enumerate(prompts)]
    for done, task in enumerate(asyncio.as_completed(tasks), 1):
        await task
        if done % max(1, len(tasks) // 10) == 0 or done == len(tasks):
            say(f"  {done}/{len(tasks)} prompts judged")
    return [task.result() for task in tasks], endpoints


def _log(opts: JudgeOptions, report: dict) -> str:
    uri = tracking_uri(opts.tracking_uri)
    report["mlflow_tracking_uri"] = redact_uri(uri)
    metrics = {f"{name}_rate": rate for name, rate in report["rates"].items()} | {
        "prompts": report["prompts"],
        "unparsable_verdicts": report["unparsable"],
    }
    params = {"a": report["a"], "b": report["b"], "judge": report["judge"], "prompts_file": opts.prompts, "max_tokens": opts.max_tokens}
    return log_command_run(
        uri,
        "lmforge-judge",
        f"judge-{Path(opts.out).name}",
        "judge",
        params,
        metrics,
        [Path(opts.out) / "report.json", Path(opts.out) / "judgments.jsonl"],
    )
