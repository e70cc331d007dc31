"""One replica's model and the life of a request on it: checked against the context
and the server's limits, answered from the response cache or turned into sequences
for the engine, and their tokens turned back into text, logprobs and usage (a whole
response, or streaming chunks as the tokens come)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
from collections import OrderedDict
from functools import partial
from typing import AsyncIterator, Callable, Optional

import torch

from lmforge.chat import chat_renderer, chat_template_of
from lmforge.errors import UserError
from lmforge.inference.adapters import adapter_rows, attach_adapters
from lmforge.inference.generate import Generator, stop_checker
from lmforge.inference.onnx_runtime import OnnxGenerator
from lmforge.inference.onnx_runtime import prompt_logits as onnx_prompt_logits
from lmforge.inference.sampling import SamplingParams
from lmforge.models.peft_format import read_peft_dir
from lmforge.serve.choices import NO_ECHO, Choice, Echo
from lmforge.serve.engine import Sequence, make_engine
from lmforge.serve.metrics import ServerMetrics
from lmforge.serve.onnx_engine import OnnxBatcher
from lmforge.serve.options import ServerOptions
from lmforge.serve.protocol import APIError, ChatRequest, CompletionRequest, Shape, logprobs_object, new_id, usage
from lmforge.serve.structured import Grammars

log = logging.getLogger(__name__)
# A token of these byte-level BPE vocabularies covers this many characters at most in
# practice: a prompt longer than context x this cannot fit, and is refused untokenized.
CHARS_PER_TOKEN = 32


class ResponseCache:
    """LRU of whole responses to temperature-0 requests, bounded in entries and in bytes
    (a key and its response, as JSON)."""

    def __init__(self, size: int, max_bytes: int = 64 << 20):
        self.size, self.max_bytes, self.bytes = size, max_bytes, 0
        self.entries: OrderedDict[str, tuple[object, int]] = OrderedDict()

    def get(self, key: str):
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key][0]
        return None

    def put(self, key: str, value) -> None:
        cost = len(key) + len(json.dumps(value))
        if not self.size or cost > self.max_bytes:
            return
        if key in self.entries:
            self.bytes -= self.entries.pop(key)[1]
        self.entries[key] = (value, cost)
        self.bytes += cost
        while len(self.entries) > self.size or self.bytes > self.max_bytes:
            self.bytes -= self.entries.popitem(last=False)[1][1]


class Backend:
    def __init__(self, options: ServerOptions):
        torch.set_num_threads(options.threads)
        self.options, self.name = options, options.name
        self.metrics = ServerMetrics(options.name, lambda: self.engine.counts)
        eos_ids = self._load(options)
        self.cache = ResponseCache(options.cache_size, options.cache_bytes)
        self.grammars = Grammars(self.tokenizer, self.vocab, eos_ids)
        self.render_chat = chat_renderer(chat_template_of(options.model, options.chat_template), "chat_template")
        self._post = None  # made on the event loop that serves requests (see _mailbox)

    def _load(self, options: ServerOptions) -> frozenset[int]:
        """The model, its tokenizer and its engine: lmforge's own model, or (`--backend
        onnxruntime`) a model directory ONNX Runtime runs. Returns the end-of-text ids."""
        if options.backend == "onnxruntime":
            onnx = OnnxGenerator(options.model)
            self.tokenizer, self.context, rows, eos_ids = onnx.tokenizer, onnx.context or 0, onnx.vocab_size, onnx.eos_ids
            self.prompt_logits = lambda prompt, adapter=0: onnx_prompt_logits(onnx, prompt)  # adapters are refused with this backend
        else:
            generator = Generator.load(options.model, options.device or "cpu", tokenizer=options.tokenizer)
            self.tokenizer, self.context, rows, eos_ids = (
                generator.tokenizer,
                generator.model.cfg.max_seq_len,
                generator.model.cfg.vocab_size,
                generator.eos_ids,
            )
            self.prompt_logits = partial(_prompt_logits, generator.model)
            if options.adapters:
                attach_adapters(generator.model, [read_peft_dir(path, generator.model.cfg) for path in options.adapters.values()])
        self.adapters = {name: slot for slot, name in enumerate(options.adapters, start=1)}  # the slot each request names
        # Token ids a prompt may hold: rows of the model that the tokenizer also names.
        self.vocab = min(rows, self.tokenizer.get_vocab_size())
        if options.backend == "onnxruntime":
            slots = options.max_running if options.batching == "continuous" else 1
            self.engine = OnnxBatcher(onnx, eos_ids, self.vocab, slots, self.metrics.batch, self.metrics.prefill)
        else:
            self.engine = make_engine(options.batching, generator.model, eos_ids, self.vocab, options.max_running, self.metrics, options.prefix_reuse)
        return eos_ids

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def model_cards(self) -> list[dict]:
        """The base model, and each adapter with the base as its parent (as vLLM lists them)."""
        base = {"id": self.name, "object": "model", "created": 0, "owned_by": "lmforge", "max_model_len": self.context}
        return [base, *(base | {"id": name, "parent": self.name} for name in self.adapters)]

    # -- a request ------------------------------------------------------------------------

    def prepare(self, kind: str, request: CompletionRequest | ChatRequest) -> tuple[list[list[int]], SamplingParams]:
        """The prompts' tokens and the sampling settings; APIError for what cannot be served."""
        if request.model != self.name and request.model not in self.adapters:
            served = ", ".join(repr(name) for name in (self.name, *self.adapters))
            raise APIError(400, f"model: {request.model!r} is not served here (GET /v1/models lists {served})", "model", "model_not_found")
        if request.n > self.options.max_n:
            raise APIError(400, f"n: at most {self.options.max_n} choices per request, got {request.n}", "n")
        asked = request.top_logprobs or 0
        if asked > self.options.max_logprobs:
            field = "logprobs" if kind == "completion" else "top_logprobs"
            raise APIError(400, f"{field}: at most {self.options.max_logprobs} alternatives per token here (--max-logprobs), got {asked}", field)
        if kind == "chat":
            try:
                texts, field = [self.render_chat([{"role": m.role, "content": m.text} for m in request.messages])], "messages"
            except UserError as err:
                raise APIError(400, str(err), "messages") from None
        else:
            texts, field = request.prompts, "prompt"
        longest_text = max((len(text) for text in texts if isinstance(text, str)), default=0)
        if longest_text > self.context * CHARS_PER_TOKEN:
            raise APIError(
                400,
                f"{field}: {longest_text} characters, more than the model's context of {self.context} tokens can hold",
                field,
                "context_length_exceeded",
            )
        # A rendered chat holds the special tokens its template writes; a completion's
        # prompt gets the tokenizer's own, as transformers' tokenizer(text) adds them.
        prompts = [self.tokenizer.encode(text, add_special_tokens=kind != "chat").ids if isinstance(text, str) else text for text in texts]
        outside = next((i for ids in prompts for i in ids if not 0 <= i < self.vocab), None)
        if outside is not None:
            raise APIError(400, f"{field}: token id {outside} is outside the model's vocabulary of {self.vocab}", field)
        longest = max(map(len, prompts), default=0)
        if not prompts or min(map(len, prompts)) == 0:
            raise APIError(400, f"{field}: an empty prompt; give at least one token of text", field)
        if longest >= self.context:
            raise APIError(400, f"{field}: {longest} tokens; the model's context is {self.context} tokens", field, "context_length_exceeded")
        limit_field = "max_completion_tokens" if kind == "chat" and request.max_completion_tokens else "max_tokens"
        max_tokens = (request.max_completion_tokens or request.max_tokens) if kind == "chat" else request.max_tokens
        max_tokens = self.context - longest if max_tokens is None else max_tokens
        if longest + max_tokens > self.context:
            raise APIError(
                400,
                f"{limit_field}: {max_tokens} new tokens after a prompt of {longest} exceed the model's context of "
                f"{self.context} tokens (at most {self.context - longest})",
                limit_field,
                "context_length_exceeded",
            )
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=request.temperature,
            top_k=max(request.top_k, 0),
            top_p=request.top_p,
            repetition_penalty=request.repetition_penalty,
            seed=request.seed,
            stop=request.stop,
            stop_at_eos=not request.ignore_eos,
        )
        return prompts, params

    async def answer(self, kind: str, request: CompletionRequest | ChatRequest) -> dict | AsyncIterator[list[dict | APIError]]:
        """A whole response, or (streaming) its chunks as they come, lists of them; an
        APIError as the last item when generation fails midway."""
        arrived = time.perf_counter()
        prompts, params = self.prepare(kind, request)
        grammar = self.grammars.compile(request)
        if grammar is not None and self.options.batching == "request":
            raise APIError(400, "response_format: structured output needs --batching continuous or off", "response_format")
        prompt_tokens = sum(map(len, prompts))
        self.metrics.prompt_tokens(prompt_tokens)
        shape = Shape(kind, new_id("cmpl" if kind == "completion" else "chatcmpl"), request.model)  # the base's name, or an adapter's
        key = json.dumps([kind, request.model_dump(exclude={"stream", "stream_options"})], sort_keys=True) if params.greedy else None
        cached = self.cache.get(key) if key and self.options.cache_size else None
        if cached is not None:
            self.metrics.cache_hit()
            return self._replay(shape, cached, request.include_usage) if request.stream else shape.response(*cached)
        # Free slots take sequences at once, so only what exceeds running plus waiting is refused.
        in_hand = sum(self.engine.counts)
        choices_count = len(prompts) * request.n
        if in_hand + choices_count > self.options.max_running + self.options.max_waiting:
            raise APIError(
                503,
                f"the server has {in_hand} sequences running or waiting (limit {self.options.max_running} running, "
                f"{self.options.max_waiting} waiting); retry later",
                kind="server_overloaded",
            )
        with_logprobs = (request.logprobs is not None) if kind == "completion" else request.logprobs
        top = request.top_logprobs or 0
        echoes = [None] * len(prompts)
        spell = self._token_id_text if request.return_tokens_as_token_ids else self._token_text
        if kind == "completion" and request.echo:  # one forward per prompt, shared by its n choices
            echoes = [
                await asyncio.to_thread(self._echo, text, ids, top if with_logprobs else None, self.adapters.get(request.model, 0), spell)
                for text, ids in zip(request.prompts, prompts)
            ]
        choices = [Choice(i, self, params.stop, with_logprobs, echoes[i // request.n], spell) for i in range(choices_count)]
        base_seed = request.seed if request.seed is not None else random.randrange(2**62)
        started = self._start(prompts, params, request.n, base_seed, top, choices, grammar, self.adapters.get(request.model, 0))
        if request.stream:
            return self._stream(shape, started, choices, prompt_tokens, request.include_usage, arrived, key)
        async for _ in self._tokens(*started, choices, arrived):
            pass
        result = ([choice.as_dict(kind) for choice in choices], usage(prompt_tokens, sum(len(c.tokens) for c in choices)))
        if key:
            self.cache.put(key, result)
        return shape.response(*result)

    def _token_text(self, token: int) -> str:
        return self.decode([token])

    @staticmethod
    def _token_id_text(token: int) -> str:
        """vLLM's `return_tokens_as_token_ids` form: exact where two tokens decode alike."""
        return f"token_id:{token}"

    def _echo(
        self, text: str | list[int], ids: list[int], top: Optional[int], adapter: int = 0, spell: Optional[Callable[[int], str]] = None
    ) -> Echo:
        """The prompt as `echo` returns it; with `top` (logprobs asked), each token's
        log-probability under the model given the ones before it, from one forward pass."""
        spell = spell or self._token_text
        text = text if isinstance(text, str) else self.decode(ids)
        if top is None:
            return Echo(text, [], [], [])
        logprobs = self.prompt_logits(ids, adapter)[:, : self.vocab].float().log_softmax(dim=-1)  # over the tokenizer's rows, as sampling is
        chosen = logprobs.gather(1, torch.tensor(ids[1:], device=logprobs.device)[:, None])[:, 0].tolist()
        best = logprobs.topk(top, dim=-1) if top else None
        tops: list = [None]
        for position in range(len(ids) - 1):
            pairs = zip(best.indices[position].tolist(), best.values[position].tolist()) if best is not None else ()
            tops.append([(spell(t), v) for t, v in pairs])
        return Echo(text, [spell(i) for i in ids], [None, *chosen], tops)

    def _start(self, prompts, params, n, base_seed, top, choices, grammar, adapter: int = 0):
        queue, post = asyncio.Queue(), self._mailbox()
        seqs = []
        if params.max_new_tokens == 0:  # `echo` alone: the prompts are the answer
            for choice in choices:
                choice.finish_reason = "length"
            return seqs, queue
        stopped = stop_checker(self.tokenizer, params.stop) if params.stop else None
        for i in range(len(choices)):

            def emit(token, index=i):
                post(queue, (index, token))

            seqs.append(
                Sequence(
                    prompts[i // n],
                    params,
                    emit,
                    seed=base_seed + i,
                    top_logprobs=top,
                    stopped=(lambda tokens: stopped(0, tokens)) if stopped else None,
                    constraint=self.grammars.constraint(grammar) if grammar is not None else None,
                    adapter=adapter,
                )
            )
        for seq in seqs:
            self.engine.submit(seq)
        return seqs, queue

    def _mailbox(self):
        """How the engine's thread hands tokens to this event loop: into a list, with one
        wake-up of the loop for all that arrive before it runs (a decode step's tokens
        for every request), not one per token."""
        if self._post is None:
            loop, pending, lock = asyncio.get_running_loop(), [], threading.Lock()

            def deliver():
                with lock:
                    items = pending[:]
                    pending.clear()
                for queue, item in items:
                    queue.put_nowait(item)

            def post(queue, item):
                with lock:
                    pending.append((queue, item))
                    first = len(pending) == 1
                if first:
                    loop.call_soon_threadsafe(deliver)

            self._post = post
        return self._post

    async def _tokens(self, seqs, queue, choices, arrived):
        """Lists of (choice, its new text, its logprobs): the tokens that arrived since the
        last list (under load several, which a stream sends as one event). The engine
        lets go of every unfinished sequence when the consumer stops listening."""
        left, first = len(seqs), True
        try:
            while left:
                arrivals = [await queue.get()]
                while not queue.empty():
                    arrivals.append(queue.get_nowait())
                now, batch = time.perf_counter(), []
                for index, token in arrivals:
                    if token.finish_reason and token.finish_reason.startswith("error"):
                        log.error("a sequence of a request failed: %s", token.finish_reason)
                        raise APIError(500, "generation failed for this request (the replica's log says why)", kind="server_error")
                    choice = choices[index]
                    self.metrics.token(now - choice.previous if choice.previous else None, now - arrived if first else None)
                    choice.previous, first = now, False
                    batch.append((choice, *choice.add(token)))
                    left -= token.finish_reason is not None
                yield batch
            self.metrics.finished(time.perf_counter() - arrived, [c.finish_reason for c in choices])
        finally:
            for seq, choice in zip(seqs, choices):
                if choice.finish_reason is None:
                    self.engine.cancel(seq)

    async def _stream(self, shape, started, choices, prompt_tokens, include_usage, arrived, key) -> AsyncIterator[list[dict | APIError]]:
        """Lists of chunks (those of one decode step together); an APIError ends it."""
        for choice in choices:
            if shape.kind == "chat":
                yield [shape.chunk(choice.index, None, None, None, first=True, with_usage=include_usage)]
            elif choice.echo is not NO_ECHO or not started[0]:  # the prompt first; or all there is, with max_tokens 0
                text, logprobs = choice.echo_chunk(shape.kind)
                yield [shape.chunk(choice.index, text, logprobs, None if started[0] else choice.finish_reason, with_usage=include_usage)]
        # Tokens are held until each running choice has `stream_interval` of them (or one
        # ends); the first goes at once. Every chunk crosses Serve's proxy on its own.
        interval, held, first = self.options.stream_interval, [], True
        try:
            async for batch in self._tokens(*started, choices, arrived):
                held += batch
                running = sum(choice.finish_reason is None for choice in choices)
                if not (first or len(held) >= interval * running or any(choice.finish_reason for choice, _, _ in batch)):
                    continue
                events = [
                    shape.chunk(choice.index, delta, logprobs, choice.finish_reason, with_usage=include_usage)
                    for choice, delta, logprobs in _merged(shape.kind, held)
                    if delta or logprobs or choice.finish_reason
                ]
                held, first = [], False
                if events:
                    yield events
        except APIError as err:
            yield [err]
            return
        use = usage(prompt_tokens, sum(len(c.tokens) for c in choices))
        if key:
            self.cache.put(key, ([choice.as_dict(shape.kind) for choice in choices], use))
        if include_usage:
            yield [shape.usage_chunk(use)]

    async def _replay(self, shape, cached, include_usage) -> AsyncIterator[list[dict | APIError]]:
        choices, use = cached
        for choice in choices:
            if shape.kind == "chat":
                yield [shape.chunk(choice["index"], None, None, None, first=True, with_usage=include_usage)]
            yield [shape.chunk(choice["index"], choice["text"], choice["logprobs"], choice["finish_reason"], with_usage=include_usage)]
        if include_usage:
            yield [shape.usage_chunk(use)]


def _prompt_logits(model, prompt: list[int], adapter: int = 0) -> torch.Tensor:
    """[len(prompt) - 1, the model's vocabulary]: the logits after each prompt token but the last, one forward
    (with an adapter's update: its slot)."""
    with torch.no_grad(), adapter_rows(model, [adapter]):
        return model(torch.tensor([prompt], device=next(model.parameters()).device))[0, :-1]


def _merged(kind: str, batch: list[tuple]) -> list[tuple]:
    """One (choice, text, logprobs object) per choice from its tokens in `batch`, in order."""
    merged: dict[int, list] = {}
    for choice, delta, logprobs in batch:
        entry = merged.setdefault(choice.index, [choice, "", None])
        entry[1] += delta
        if logprobs:
            entry[2] = {key: (entry[2] or {}).get(key, []) + value for key, value in logprobs.items()}
    return [(choice, text, logprobs_object(kind, lp["pieces"], lp["logprobs"], lp["tops"]) if lp else None) for choice, text, lp in merged.values()]
