"""The gRPC face of a replica, beside its HTTP one: `lmforge.v1.Completions`
(serve/proto/completions.proto), called by Ray Serve's gRPC proxy. A message becomes
the same `CompletionRequest` HTTP builds, with the same checks, limits, API key and
engine; an error's HTTP status becomes the gRPC status code that means it."""

from __future__ import annotations

import hmac
from typing import AsyncIterator

import grpc

from lmforge.serve.backend import Backend
from lmforge.serve.options import key_digest
from lmforge.serve.proto import completions_pb2 as pb
from lmforge.serve.protocol import APIError, CompletionRequest, parse

SERVICER = "lmforge.serve.proto.completions_pb2_grpc.add_CompletionsServicer_to_server"
STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    503: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "n", "seed")


class GrpcCompletions:
    def __init__(self, backend: Backend):
        self.backend = backend

    async def complete(self, message: pb.CompletionRequest, context) -> pb.CompletionResponse:
        try:
            answer = await self.backend.answer("completion", self._request(message, context, stream=False))
        except APIError as err:
            return self._failed(err, context, pb.CompletionResponse())
        assert isinstance(answer, dict)
        choices = [pb.Choice(index=c["index"], text=c["text"], finish_reason=c["finish_reason"] or "") for c in answer["choices"]]
        return pb.CompletionResponse(id=answer["id"], model=answer["model"], choices=choices, usage=pb.Usage(**answer["usage"]))

    async def complete_stream(self, message: pb.CompletionRequest, context) -> AsyncIterator[pb.CompletionChunk]:
        try:
            answer = await self.backend.answer("completion", self._request(message, context, stream=True))
        except APIError as err:
            self._failed(err, context, None)
            return
        assert not isinstance(answer, dict)
        async for events in answer:
            for event in events:
                if isinstance(event, APIError):
                    self._failed(event, context, None)
                    return
                if event["choices"]:
                    c = event["choices"][0]
                    yield pb.CompletionChunk(
                        id=event["id"], choice=pb.Choice(index=c["index"], text=c["text"], finish_reason=c["finish_reason"] or "")
                    )
                else:
                    yield pb.CompletionChunk(id=event["id"], usage=pb.Usage(**event["usage"]))

    def _request(self, message: pb.CompletionRequest, context, stream: bool) -> CompletionRequest:
        """The API key from the call's metadata, then the message as HTTP's request body."""
        wanted = self.backend.options.api_key_sha256
        if wanted:
            token = dict(context.invocation_metadata() or ()).get("authorization", "")
            scheme, _, key = token.strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key_digest(key.strip()), wanted):
                raise APIError(401, "a valid API key is required: metadata authorization: Bearer KEY", code="invalid_api_key")
        body: dict = {"model": message.model, "prompt": list(message.prompt_token_ids) or message.prompt, "stream": stream}
        body |= {name: getattr(message, name) for name in OPTIONAL_FIELDS if message.HasField(name)}
        if message.stop:
            body["stop"] = list(message.stop)
        if message.ignore_eos:
            body["ignore_eos"] = True
        if message.json_schema:
            body["structured_outputs"] = {"json": message.json_schema}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return parse(CompletionRequest, body)  # type: ignore[return-value]

    def _failed(self, err: APIError, context, response):
        """Answer with the error's code and message (its field named as the .proto names it)."""
        self.backend.metrics.error(err.status)
        context.set_code(STATUS_CODES.get(err.status, grpc.StatusCode.INTERNAL))
        context.set_details(err.message.replace("structured_outputs.json", "json_schema"))
        return response
