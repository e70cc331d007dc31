"""A teacher behind an OpenAI-compatible server (`lmforge serve`, vLLM): every position's
top-k log-probabilities from one `echo` completion of the row with `max_tokens` 0, the
tokens named by id (vLLM's `return_tokens_as_token_ids`), in the offline cache's shape.
Rows go up to 64 to a request, several requests in flight; the openai client retries a
failed request with exponential backoff, and a teacher that stays down raises."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional

import numpy as np

from lmforge.distill.config import ServedTeacherSpec
from lmforge.errors import UserError

if TYPE_CHECKING:
    import openai

ROWS_PER_REQUEST = 64  # the server's bound on prompts in one completions request
IN_FLIGHT = 4  # requests at once
TOKEN_ID = "token_id:"


class ServedTeacherError(RuntimeError):
    """The server answered, but not with what a teacher must give (a training attempt fails on it)."""


class ServedTeacher:
    """Asks the server for rows' top-k targets. Picklable (a feed reader actor holds one):
    the HTTP client is made where it is first used."""

    def __init__(
        self, url: str, model: str, k: int, api_key: Optional[str] = None, in_flight: int = IN_FLIGHT, max_retries: int = 5, timeout_s: float = 300
    ):
        self.url, self.model, self.k, self.in_flight = url, model, k, in_flight
        self.api_key, self.max_retries, self.timeout_s = api_key, max_retries, timeout_s
        self._client: Optional[openai.OpenAI] = None
        self.bytes_received = 0  # the responses' bodies: the wire's cost of the targets
        self.tokens_scored = 0

    def __getstate__(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if name != "_client"} | {"_client": None}

    @property
    def client(self) -> openai.OpenAI:
        if self._client is None:
            openai = _openai()
            self._client = openai.OpenAI(base_url=self.url, api_key=self.api_key or "none", max_retries=self.max_retries, timeout=self.timeout_s)
        return self._client

    @classmethod
    def of(cls, served: ServedTeacherSpec, k: int, in_flight: int = IN_FLIGHT) -> "ServedTeacher":
        """The job's `distill.teacher: {url, model, api_key_env}`, its key read from that variable."""
        key = os.environ.get(served.api_key_env) if served.api_key_env else None
        return cls(served.url, served.model, k, key, in_flight, max_retries=served.max_retries)

    def check(self) -> None:
        """Before anything starts: the server answers a two-token echo with k alternatives
        named by id; UserError naming `distill.teacher.url` otherwise (one retry: a server
        that is down says so in a second, not after the backoff a job's requests get)."""
        try:
            self._score([[0, 0]], self.client.with_options(max_retries=1))
        except (_openai().OpenAIError, ServedTeacherError) as err:
            raise UserError(f"distill.teacher.url: {self.client.base_url} cannot teach: {str(err).splitlines()[0][:300]}") from None

    def score(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of tokens [rows, length] -> the teacher's top-k ids (int32) and
        log-probabilities (float32) after each prefix, [rows, length - 1, k]."""
        rows = [list(map(int, row)) for row in tokens]
        groups = [rows[i : i + ROWS_PER_REQUEST] for i in range(0, len(rows), ROWS_PER_REQUEST)]
        try:
            with ThreadPoolExecutor(self.in_flight) as pool:
                scored = [row for group in pool.map(self._score, groups) for row in group]
        except _openai().OpenAIError as err:  # as a plain error: openai's do not cross a process boundary (they do not unpickle)
            raise ServedTeacherError(
                f"the served teacher at {self.url} did not answer ({self.max_retries} retries): {str(err).splitlines()[0][:300]}"
            ) from None
        self.tokens_scored += sum(len(row) - 1 for row in rows)
        return np.stack([ids for ids, _ in scored]).astype(np.int32), np.stack([values for _, values in scored]).astype(np.float32)

    def __call__(self, batch: dict) -> dict:
        """A Ray Data batch of samples -> their top-k targets, as `TeacherTopK` gives them (fp16, as the cache keeps them)."""
        tokens = batch["tokens"]
        ids, logprobs = self.score(np.stack(tokens) if tokens.dtype == object else tokens)
        rows = len(ids)
        return {"sample_id": batch["sample_id"], "topk_ids": ids.reshape(rows, -1), "topk_logprobs": logprobs.astype(np.float16).reshape(rows, -1)}

    def _score(self, rows: list[list[int]], client: Optional[openai.OpenAI] = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per row: [len - 1, k] ids and log-probabilities, most likely first: the teacher's
        next-token distribution after each prefix."""
        raw = (client or self.client).completions.with_raw_response.create(
            model=self.model, prompt=rows, echo=True, max_tokens=0, logprobs=self.k, extra_body={"return_tokens_as_token_ids": True}
        )
        self.bytes_received += len(raw.content)
        choices = sorted(raw.parse().choices, key=lambda choice: choice.index)
        if len(choices) != len(rows):
            raise ServedTeacherError(f"asked to score {len(rows)} prompts, the server answered {len(choices)}")
        return [self._row(choice, len(row)) for choice, row in zip(choices, rows)]

    def _row(self, choice, length: int) -> tuple[np.ndarray, np.ndarray]:
        tops = (choice.logprobs.top_logprobs if choice.logprobs else None) or []
        if len(tops) != length or any(top is None or len(top) < self.k for top in tops[1:]):
            raise ServedTeacherError(f"the server gave no top-{self.k} log-probabilities for every prompt token (echo with logprobs)")
        ids, values = np.empty((length - 1, self.k), np.int64), np.empty((length - 1, self.k), np.float32)
        for position, top in enumerate(tops[1:]):
            best = sorted(top.items(), key=lambda item: -item[1])[: self.k]
            if not all(name.startswith(TOKEN_ID) for name, _ in best):
                raise ServedTeacherError("the server names tokens by their text; a teacher needs their ids (vLLM's return_tokens_as_token_ids)")
            ids[position] = [int(name.removeprefix(TOKEN_ID)) for name, _ in best]
            values[position] = [value for _, value in best]
        return ids, values


def _openai():
    """The openai client library, loaded where a served teacher is first asked: every
    rank and controller imports this module, and the library costs each 0.5 CPU-seconds."""
    import openai

    return openai


def served_scorer(distill) -> Optional[ServedTeacher]:
    """The job's served teacher when training straight from it (no offline cache): the
    feed asks it for each chunk's targets as it reads the chunk. None otherwise."""
    if distill is None or distill.served is None or distill.cache is not None:
        return None
    return ServedTeacher.of(distill.served, distill.top_k)
