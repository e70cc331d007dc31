"""The HTTP face of a replica (FastAPI): OpenAI's `/v1/completions`,
`/v1/chat/completions` and `/v1/models`, plus `/health` and Prometheus `/metrics`.
With an API key, the `/v1` routes want `Authorization: Bearer KEY` (401 otherwise)."""

from __future__ import annotations

import hashlib
import hmac
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmforge.serve.backend import Backend
from lmforge.serve.protocol import APIError, ChatRequest, CompletionRequest, parse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def build_api(backend: Backend) -> FastAPI:
    api = FastAPI(title=f"lmforge: {backend.name}", docs_url=None, redoc_url=None, openapi_url=None)
    wanted = backend.options.api_key_sha256

    def failed(err: APIError) -> JSONResponse:
        backend.metrics.error(err.status)
        return JSONResponse(err.body(), status_code=err.status)

    @api.middleware("http")
    async def authenticate(request: Request, call_next):
        if wanted and "/v1/" in request.url.path:  # under a route prefix too; /health and /metrics stay open
            header = request.headers.get("authorization", "")
            given = header[len("Bearer "):] if header.startswith("Bearer ") else ""
            if not hmac.compare_digest(key_digest(given), wanted):
                return failed(APIError(401, "a valid API key is required: Authorization: Bearer KEY", code="invalid_api_key"))
        return await call_next(request)

    @api.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception):
        return failed(APIError(500, f"the server failed: {type(err).__name__}: {err}", kind="server_error"))

    async def body_of(request: Request) -> object:
        try:
            return json.loads(await request.body())
        except ValueError as err:
            raise APIError(400, f"malformed JSON in the request body ({err})") from None

    async def serve(kind: str, model, request: Request):
        try:
            answer = await backend.answer(kind, parse(model, await body_of(request)))
        except APIError as err:
            return failed(err)
        if isinstance(answer, dict):
            return JSONResponse(answer)
        return StreamingResponse(answer, media_type="text/event-stream", headers=SSE_HEADERS)

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await serve("completion", CompletionRequest, request)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve("chat", ChatRequest, request)

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [backend.model_card()]}

    @api.get("/health")
    async def health():
        return {"status": "ok", "model": backend.name}

    @api.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(backend.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return api
