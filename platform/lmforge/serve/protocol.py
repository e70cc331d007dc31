"""The OpenAI API as lmforge serves it: request bodies (with vLLM's extras `top_k` and
`repetition_penalty`), errors in OpenAI's JSON shape, and the response and
streaming-chunk objects of completions and chat completions."""

from __future__ import annotations

import time
import uuid
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lmforge.inference.sampling import MAX_SEED, PENALTY_RANGE

# Bounds every field is checked against at the door (a 400 naming it), so no value
# reaches a decode step that other requests share and fails there.
MAX_STOP_CHARS = 256  # each stop string: matched on the event loop as tokens arrive
MAX_PROMPTS = 64  # prompts in one completions request
MAX_N = 128  # the door's bound; a server's own --max-n is usually lower
MAX_TOKENS = 1 << 20
MAX_LOGPROBS = 1024  # the door's bound on top alternatives; a server's own --max-logprobs is lower (OpenAI's: 5, vLLM's default: 20)


class APIError(Exception):
    """Answered as `{"error": {message, type, param, code}}` with this status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


MAX_CHOICES = 256  # strings of a `choice` constraint
MAX_PATTERN_CHARS = 16 << 10  # a regex or Lark grammar


class JSONSchemaFormat(BaseModel):
    name: str = Field("response", max_length=64)
    description: Optional[str] = None
    schema_: dict = Field(default_factory=dict, alias="schema")  # `schema` would shadow BaseModel's
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    """OpenAI's: free text, any JSON object, or JSON that validates against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema: {name, schema}")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's: exactly one of a JSON schema, a regex, a list of choices or a Lark grammar."""

    model_config = ConfigDict(extra="forbid")

    json_schema: Optional[Union[dict, str]] = Field(None, alias="json")
    regex: Optional[str] = Field(None, min_length=1, max_length=MAX_PATTERN_CHARS)
    choice: Optional[list[str]] = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: Optional[str] = Field(None, min_length=1, max_length=MAX_PATTERN_CHARS)

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [name for name in ("json_schema", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"exactly one of json, regex, choice or grammar, got {len(given)}")
        return self


class _Sampling(BaseModel):
    # Fields of OpenAI's this server does not use (user, ...) are ignored; NaN and infinities are not numbers here.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(max_length=256)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=1 << 20)  # vLLM's extra; -1 or 0: no limit
    repetition_penalty: float = Field(1.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = Field(None, validate_default=True)
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False  # vLLM's extra: generate max_tokens whatever the model says (benchmarks)
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None  # vLLM's extra
    return_tokens_as_token_ids: bool = False  # vLLM's extra: logprobs name tokens "token_id:ID", exact where texts collide

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.structured_outputs is not None and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format and structured_outputs: give one of them")
        return self

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops):
            raise ValueError("an empty stop string would stop at once")
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string of at most {MAX_STOP_CHARS} characters")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of lists of token ids"


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


class CompletionRequest(_Sampling):
    # Text, texts, token ids or lists of them (what lm-evaluation-harness sends).
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=0, le=MAX_TOKENS)  # 0 with echo: the prompt's logprobs alone
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)  # more than the server's --max-logprobs: a 400 naming it
    echo: bool = False  # the prompt, and with logprobs its tokens' (the first null), before the completion

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, prompt):
        if isinstance(prompt, str) or (_is_ids(prompt) and prompt):
            return prompt
        if not isinstance(prompt, list) or not all(isinstance(p, str) for p in prompt) and not all(map(_is_ids, prompt)):
            raise ValueError(PROMPT_FORMS)
        if not 1 <= len(prompt) <= MAX_PROMPTS:
            raise ValueError(f"from 1 to {MAX_PROMPTS} prompts, got {len(prompt)}")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: its text, or its token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]

    @property
    def top_logprobs(self) -> int:
        return self.logprobs or 0


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[TextPart]]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)


def parse(model: type[BaseModel], body: object) -> BaseModel:
    """The request, or a 400 naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors(include_input=False, include_url=False)[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


class Shape:
    """How one endpoint's responses and chunks look: `completion` or `chat`."""

    def __init__(self, kind: str, request_id: str, model: str):
        self.kind, self.id, self.model, self.created = kind, request_id, model, int(time.time())

    def _object(self, obj: str, choices: list, extra: Optional[dict] = None) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices} | (extra or {})

    def response(self, choices: list[dict], use: dict) -> dict:
        """`choices`: {index, text, logprobs, finish_reason}."""
        if self.kind == "completion":
            return self._object("text_completion", choices, {"usage": use})
        return self._object(
            "chat.completion",
            [
                {
                    "index": c["index"],
                    "message": {"role": "assistant", "content": c["text"]},
                    "logprobs": c["logprobs"],
                    "finish_reason": c["finish_reason"],
                }
                for c in choices
            ],
            {"usage": use},
        )

    def chunk(
        self, index: int, text: Optional[str], logprobs: Optional[dict], finish_reason: Optional[str], first: bool = False, with_usage: bool = False
    ) -> dict:
        extra = {"usage": None} if with_usage else None
        if self.kind == "completion":
            return self._object(
                "text_completion", [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}], extra
            )
        delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": text} if text else {})
        return self._object("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}], extra)

    def usage_chunk(self, use: dict) -> dict:
        return self._object("text_completion" if self.kind == "completion" else "chat.completion.chunk", [], {"usage": use})


def logprobs_object(
    kind: str, pieces: list[str], logprobs: list[Optional[float]], tops: list[Optional[list[tuple[str, float]]]], offset: int = 0
) -> dict:
    """Tokens (as text) and their log-probabilities in the endpoint's format (an echoed
    prompt's first token has None for both, as OpenAI gives it)."""
    if kind == "completion":
        offsets, at = [], offset
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {
            "tokens": pieces,
            "token_logprobs": logprobs,
            "top_logprobs": [None if top is None else dict(top) for top in tops],
            "text_offset": offsets,
        }
    return {
        "content": [
            {
                "token": piece,
                "logprob": logprob,
                "bytes": list(piece.encode()),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top],
            }
            for piece, logprob, top in zip(pieces, logprobs, tops)
        ]
    }


def sse(payload: dict | str) -> str:
    import json

    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
