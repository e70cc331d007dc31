"""Structured output: a request's `response_format` (OpenAI's json_object and
json_schema) or `structured_outputs` (vLLM's json, regex, choice and Lark grammar),
compiled by llguidance over the replica's tokenizer, and one matcher per sequence
that leaves only the tokens its grammar allows at each step."""

from __future__ import annotations

import json
import re
from typing import Optional

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer
from tokenizers import Tokenizer

from lmforge.serve.protocol import APIError, ChatRequest, CompletionRequest

# JSON without free whitespace between its tokens: a small model allowed any amount
# can spend its whole budget on blanks (OpenAI's and vLLM's outputs are compact too).
JSON_OPTIONS = {"whitespace_flexible": False}


class Grammars:
    """What the grammars of one replica's requests are compiled against: its tokenizer,
    the model's rows and its end-of-text tokens."""

    def __init__(self, tokenizer: Tokenizer, vocab: int, eos_ids: frozenset[int]):
        self.tokenizer, self.vocab, self.eos_ids = tokenizer, vocab, eos_ids
        self._ll: Optional[LLTokenizer] = None

    @property
    def ll(self) -> LLTokenizer:
        if self._ll is None:  # made at the first constrained request: ~1 s for a 128k vocabulary
            self._ll = LLTokenizer(self.tokenizer.to_str(), n_vocab=self.tokenizer.get_vocab_size(), eos_token=sorted(self.eos_ids))
        return self._ll

    def compile(self, request: CompletionRequest | ChatRequest) -> Optional[str]:
        """The request's grammar, checked against the tokenizer; None when it asks for
        none. A 400 naming the field for one that cannot be compiled."""
        field, grammar = _grammar_of(request)
        if grammar is None:
            return None
        problem = LLMatcher.validate_grammar(grammar, self.ll)
        if problem:
            raise APIError(400, f"{field}: cannot be compiled ({problem.strip().splitlines()[0]})", field)
        return grammar

    def constraint(self, grammar: str) -> "Constraint":
        return Constraint(LLMatcher(self.ll, grammar, log_level=0), self.vocab)


class Constraint:
    """One sequence's matcher: the tokens allowed next, as a mask over the model's rows."""

    def __init__(self, matcher: LLMatcher, vocab: int):
        self.matcher, self.vocab = matcher, vocab

    def allowed(self, device: torch.device) -> torch.Tensor:
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = np.zeros(self.vocab, dtype=bool)
        shared = min(self.vocab, bits.size)
        mask[:shared] = bits[:shared].astype(bool)
        if not mask.any():
            raise RuntimeError(f"the grammar allows no token here ({self.matcher.get_error() or 'no way on'})")
        return torch.from_numpy(mask).to(device)

    def accept(self, token: int) -> bool:
        """Consume the chosen token; whether the grammar is complete (nothing may follow)."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        return self.matcher.is_stopped()


def _grammar_of(request: CompletionRequest | ChatRequest) -> tuple[str, Optional[str]]:
    """(the field it came from, an llguidance grammar or None)."""
    wanted = request.structured_outputs
    if wanted is not None:
        field = "structured_outputs"
        if wanted.json_schema is not None:
            return f"{field}.json", _from_schema(f"{field}.json", wanted.json_schema)
        if wanted.regex is not None:
            return f"{field}.regex", LLMatcher.grammar_from_regex(wanted.regex)
        if wanted.choice is not None:
            return f"{field}.choice", LLMatcher.grammar_from_regex("|".join(f"({re.escape(choice)})" for choice in wanted.choice))
        return f"{field}.grammar", LLMatcher.grammar_from_lark(wanted.grammar or "")
    form = request.response_format
    if form is None or form.type == "text":
        return "response_format", None
    if form.type == "json_object":
        return "response_format", _from_schema("response_format", {"type": "object"})
    return "response_format.json_schema.schema", _from_schema(
        "response_format.json_schema.schema", form.json_schema.schema_ if form.json_schema else {}
    )


def _from_schema(field: str, schema: dict | str) -> str:
    try:
        return LLMatcher.grammar_from_json_schema(json.loads(schema) if isinstance(schema, str) else schema, defaults=JSON_OPTIONS)
    except ValueError as err:
        raise APIError(400, f"{field}: not a JSON schema ({err})", field) from None
