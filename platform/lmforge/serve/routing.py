"""Length-aware routing (`lmforge serve --long-prompt-tokens N`): an ingress that counts
each request's prompt tokens and sends prompts of N tokens or more to replicas of their
own, so that long prefills queue behind each other there while short requests keep
their replicas to themselves. The ingress checks the key and the body's size; the
replicas answer exactly as without routing (the same checks, engine and responses)."""

from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from ray.serve.handle import DeploymentHandle
from tokenizers import Tokenizer

from lmforge.checkpoint.export import open_source
from lmforge.serve.api import SSE_HEADERS, body_bytes, json_body, unauthorized
from lmforge.serve.backend import CHARS_PER_TOKEN
from lmforge.serve.options import ServerOptions
from lmforge.serve.protocol import APIError, ChatRequest, CompletionRequest, parse

POOLS = ("short", "long")


class PromptLength:
    """How many tokens a request's prompt holds, as far as routing needs to know: text
    too long to be short is not tokenized."""

    def __init__(self, options: ServerOptions, long_prompt_tokens: int):
        self.tokenizer = _tokenizer_of(options)
        self.threshold = long_prompt_tokens

    def pool(self, kind: str, body: object) -> str:
        """ "long" or "short"; a request a replica would refuse goes to "short", to be refused there."""
        try:
            request = parse(CompletionRequest if kind == "completion" else ChatRequest, body)
        except APIError:
            return "short"
        if isinstance(request, CompletionRequest):  # separate sequences: the longest counts
            count = max(map(self.tokens, request.prompts), default=0)
        else:  # a chat's messages are one prompt
            assert isinstance(request, ChatRequest)
            count = sum(self.tokens(message.text) for message in request.messages)
        return "long" if count >= self.threshold else "short"

    def tokens(self, prompt: str | list[int]) -> int:
        if isinstance(prompt, list):
            return len(prompt)  # token ids
        if len(prompt) >= self.threshold * CHARS_PER_TOKEN:
            return self.threshold
        return len(self.tokenizer.encode(prompt, add_special_tokens=False).ids)


def _tokenizer_of(options: ServerOptions) -> Tokenizer:
    """The tokenizer the replicas use: --tokenizer, the directory's own, or its source's."""
    given = options.tokenizer or Path(options.model) / "tokenizer.json"
    if Path(given).is_file():
        return Tokenizer.from_file(str(given))
    return open_source(options.model, options.tokenizer).tokenizer()


def build_router_api(options: ServerOptions, length: PromptLength, pools: dict[str, DeploymentHandle]) -> FastAPI:
    api = FastAPI(title=f"lmforge: {options.name} (routed by length)", docs_url=None, redoc_url=None, openapi_url=None)
    registry = CollectorRegistry()
    routed = Counter("lmforge:routed_requests", "Requests sent to each pool of replicas.", ["model_name", "pool"], registry=registry)

    def failed(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @api.middleware("http")
    async def authenticate(request: Request, call_next):
        refused = unauthorized(request, options.api_key_sha256)
        return failed(refused) if refused else await call_next(request)

    async def relay(kind: str, request: Request):
        try:
            data = await body_bytes(request, options.max_body_bytes)
            pool = length.pool(kind, json_body(data))
        except APIError as err:
            return failed(err)
        routed.labels(model_name=options.name, pool=pool).inc()
        answer = pools[pool].options(stream=True).relay.remote(kind, data)
        form, status, payload = await answer.__anext__()
        if form != "stream":
            return JSONResponse(payload, status_code=status)
        return StreamingResponse(_texts(answer), media_type="text/event-stream", headers=SSE_HEADERS)

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await relay("completion", request)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await relay("chat", request)

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": await pools["short"].model_cards.remote()}

    @api.get("/health")
    async def health():
        return {"status": "ok", "model": options.name}

    @api.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return api


async def _texts(answer) -> AsyncIterator[str]:
    async for text in answer:
        yield text
