"""A replica's Prometheus metrics, under vLLM's names with lmforge's prefix where
they fit (`lmforge:num_requests_running`, `lmforge:time_to_first_token_seconds`, ...),
in a registry of its own and served as text on `/metrics`."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no `_created` series beside each counter and histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServerMetrics:
    def __init__(self, model: str, counts: Callable[[], tuple[int, int]]):
        """`counts()`: the engine's (running, waiting) sequences, read at each scrape."""
        self.registry = registry = CollectorRegistry()
        labels = {"model_name": model}

        def gauge(name, doc, pick):
            Gauge(f"lmforge:{name}", doc, list(labels), registry=registry).labels(**labels).set_function(lambda: counts()[pick])

        gauge("num_requests_running", "Sequences in the decode batch.", 0)
        gauge("num_requests_waiting", "Sequences waiting for a slot.", 1)

        def make(kind, name, doc, extra=(), **kw):
            return kind(f"lmforge:{name}", doc, [*labels, *extra], registry=registry, **kw)

        self._prompt = make(Counter, "prompt_tokens", "Prompt tokens prefilled.").labels(**labels)
        self._generated = make(Counter, "generation_tokens", "Tokens generated.").labels(**labels)
        self._ttft = make(Histogram, "time_to_first_token_seconds", "Arrival to first token.", buckets=LATENCY_BUCKETS).labels(**labels)
        self._itl = make(Histogram, "inter_token_latency_seconds", "Between a sequence's tokens.", buckets=LATENCY_BUCKETS).labels(**labels)
        self._e2e = make(Histogram, "e2e_request_latency_seconds", "Arrival to last token.", buckets=LATENCY_BUCKETS).labels(**labels)
        self._batch = make(Histogram, "batch_size", "Sequences in each decode step.", buckets=BATCH_BUCKETS).labels(**labels)
        self._prefix_queries = make(Counter, "prefix_cache_queries", "Prompt tokens looked up in the replica's slots.").labels(**labels)
        self._prefix_hits = make(Counter, "prefix_cache_hits", "Prompt tokens a slot held: copied, not computed.").labels(**labels)
        self._hits = make(Counter, "response_cache_hits", "Requests answered from the response cache.").labels(**labels)
        self._success = make(Counter, "request_success", "Finished requests by finish reason.", ("finished_reason",))
        self._errors = make(Counter, "request_errors", "Requests answered with an error, by status.", ("status",))
        self._labels = labels

    def prompt_tokens(self, n: int) -> None:
        self._prompt.inc(n)

    def token(self, since_previous: float | None, since_arrival: float | None) -> None:
        """A generated token: the time since its sequence's previous token, or (the first) since the request arrived."""
        self._generated.inc()
        if since_previous is not None:
            self._itl.observe(since_previous)
        if since_arrival is not None:
            self._ttft.observe(since_arrival)

    def finished(self, seconds: float, reasons: list[str]) -> None:
        self._e2e.observe(seconds)
        for reason in reasons:
            self._success.labels(**self._labels, finished_reason=reason).inc()

    def batch(self, size: int) -> None:
        self._batch.observe(size)

    def prefill(self, prompt: int, reused: int) -> None:
        self._prefix_queries.inc(prompt)
        self._prefix_hits.inc(reused)

    def cache_hit(self) -> None:
        self._hits.inc()

    def error(self, status: int) -> None:
        self._errors.labels(**self._labels, status=str(status)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
