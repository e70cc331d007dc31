"""A teacher behind an OpenAI-compatible server (`lmforge serve`, vLLM): every position's
top-k log-probabilities from one `echo` completion of the row with `max_tokens` 0, the
tokens named by id (vLLM's `return_tokens_as_token_ids`), in the offline cache's shape.
Rows go up to 64 to a request, several requests in flight; the openai client retries a
failed request with exponential backoff, and a teacher that stays down raises."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np
import openai

from lmforge.distill.config import ServedTeacherSpec
from lmforge.errors import UserError

ROWS_PER_REQUEST = 64  # the server's bound on prompts in one completions request
IN_FLIGHT = 4  # requests at once
TOKEN_ID = "token_id:"


class ServedTeacherError(RuntimeError):
    """The server answered, but not with what a teacher must give (a training attempt fails on it)."""


class ServedTeacher:
    def __init__(
        self, url: str, model: str, k: int, api_key: Optional[str] = None, in_flight: int = IN_FLIGHT, max_retries: int = 5, timeout_s: float = 300
    ):
        self.model, self.k, self.in_flight = model, k, in_flight
        self.client = openai.OpenAI(base_url=url, api_key=api_key or "none", max_retries=max_retries, timeout=timeout_s)
        self.bytes_received = 0  # the responses' bodies: the wire's cost of the targets

    @classmethod
    def of(cls, served: ServedTeacherSpec, k: int, in_flight: int = IN_FLIGHT) -> "ServedTeacher":
        """The job's `distill.teacher: {url, model, api_key_env}`, its key read from that variable."""
        return cls(served.url, served.model, k, os.environ.get(served.api_key_env) if served.api_key_env else None, in_flight)

    def check(self) -> None:
        """Before anything starts: the server answers a two-token echo with k alternatives
        named by id; UserError naming `distill.teacher.url` otherwise (one retry: a server
        that is down says so in a second, not after the backoff a job's requests get)."""
        try:
            self._score([[0, 0]], self.client.with_options(max_retries=1))
        except (openai.OpenAIError, ServedTeacherError) as err:
            raise UserError(f"distill.teacher.url: {self.client.base_url} cannot teach: {str(err).splitlines()[0][:300]}") from None

    def __call__(self, batch: dict) -> dict:
        """A Ray Data batch of samples -> their top-k targets, as `TeacherTopK` gives them."""
        tokens = batch["tokens"]
        rows = [list(map(int, row)) for row in (np.stack(tokens) if tokens.dtype == object else tokens)]
        groups = [rows[i : i + ROWS_PER_REQUEST] for i in range(0, len(rows), ROWS_PER_REQUEST)]
        with ThreadPoolExecutor(self.in_flight) as pool:
            scored = [row for group in pool.map(self._score, groups) for row in group]
        ids = np.stack([ids for ids, _ in scored]).astype(np.int32)
        logprobs = np.stack([values for _, values in scored]).astype(np.float16)
        return {"sample_id": batch["sample_id"], "topk_ids": ids.reshape(len(rows), -1), "topk_logprobs": logprobs.reshape(len(rows), -1)}

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
