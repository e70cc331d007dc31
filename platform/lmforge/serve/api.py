"""The HTTP face of a replica (FastAPI): OpenAI's `/v1/completions`,
`/v1/chat/completions` and `/v1/models`, plus `/health` and Prometheus `/metrics`.
With an API key every route but `/health` wants `Authorization: Bearer KEY` (401
otherwise). Bodies are bounded (413), and every error is OpenAI's JSON shape with no
internals in it: what went wrong inside is logged on the replica."""

from __future__ import annotations

import hmac
import json
import logging
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmforge.serve.backend import Backend
from lmforge.serve.options import key_digest
from lmforge.serve.protocol import APIError, ChatRequest, CompletionRequest, parse, sse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
OPEN_ROUTES = ("/health",)  # probes (a load balancer, Kubernetes) carry no key; it says only "ok" and the model's name
log = logging.getLogger(__name__)


def build_api(backend: Backend) -> FastAPI:
    api = FastAPI(title=f"lmforge: {backend.name}", docs_url=None, redoc_url=None, openapi_url=None)
    wanted = backend.options.api_key_sha256

    def failed(err: APIError) -> JSONResponse:
        backend.metrics.error(err.status)
        return JSONResponse(err.body(), status_code=err.status)

    @api.middleware("http")
    async def authenticate(request: Request, call_next):
        refused = unauthorized(request, wanted)
        return failed(refused) if refused else await call_next(request)

    @api.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception):
        log.exception("a request to %s failed", request.url.path)
        return failed(APIError(500, "the server failed to answer this request (the replica's log says why)", kind="server_error"))

    async def serve(kind: str, model, request: Request):
        try:
            answer = await backend.answer(kind, parse(model, json_body(await body_bytes(request, backend.options.max_body_bytes))))
        except APIError as err:
            return failed(err)
        if isinstance(answer, dict):
            return JSONResponse(answer)
        return StreamingResponse(server_sent_events(answer), media_type="text/event-stream", headers=SSE_HEADERS)

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await serve("completion", CompletionRequest, request)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve("chat", ChatRequest, request)

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": backend.model_cards()}

    @api.get("/health")
    async def health():
        return {"status": "ok", "model": backend.name}

    @api.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(backend.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return api


def unauthorized(request: Request, wanted: Optional[str]) -> Optional[APIError]:
    """A 401 when a key is wanted and this request to a guarded route lacks it."""
    open_route = request.url.path.rstrip("/").endswith(OPEN_ROUTES)  # under a route prefix too
    if wanted and not open_route and not hmac.compare_digest(key_digest(bearer_token(request.headers.get("authorization", ""))), wanted):
        return APIError(401, "a valid API key is required: Authorization: Bearer KEY", code="invalid_api_key")
    return None


async def body_bytes(request: Request, limit: int) -> bytes:
    """The body, at most `limit` bytes of it read (413 past that)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {int(declared)} bytes; at most {limit}", code="request_too_large")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise APIError(413, f"the request body is over {limit} bytes", code="request_too_large")
    return bytes(data)


async def server_sent_events(chunks: AsyncIterator[list[dict | APIError]]) -> AsyncIterator[str]:
    """A stream's chunks as `data:` events (those of one step in one write), an error
    in OpenAI's shape, then `data: [DONE]`."""
    async for events in chunks:
        yield "".join(sse(event.body() if isinstance(event, APIError) else event) for event in events)
    yield sse("[DONE]")


def bearer_token(header: str) -> str:
    """The token of an `Authorization: Bearer TOKEN` header (the scheme in any case, RFC 7235)."""
    scheme, _, token = header.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def json_body(data: bytes) -> object:
    """A body parsed as JSON whose text is valid Unicode throughout; a 400 otherwise."""
    try:
        body = json.loads(data)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except ValueError as err:
        reason = err.msg if isinstance(err, json.JSONDecodeError) else "not UTF-8 text"
        raise APIError(400, f"malformed JSON in the request body ({reason})") from None
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the request body holds a lone surrogate (\\ud800-\\udfff): not valid Unicode text") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    return body
