"""One choice of a response as its tokens arrive: the text a client may be sent so far
(held back where it may end in a partial character or the start of a stop string), its
logprobs, and what `echo` puts before it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from lmforge.serve.engine import Token
from lmforge.serve.protocol import logprobs_object

if TYPE_CHECKING:
    from lmforge.serve.backend import Backend


class Choice:
    """One sequence's tokens so far and the text a client has been sent of them."""

    def __init__(
        self,
        index: int,
        backend: "Backend",
        stops: list[str],
        with_logprobs: bool,
        echo: Optional[Echo] = None,
        spell: Optional[Callable[[int], str]] = None,
    ):
        """`spell`: how logprobs name a token (its text, or vLLM's "token_id:ID")."""
        self.index, self.backend, self.stops, self.with_logprobs = index, backend, stops, with_logprobs
        self.spell = spell or (lambda token: backend.decode([token]))
        self.echo = echo or NO_ECHO
        self.tokens, self.logprobs, self.tops, self.pieces = [], [], [], []
        self.sent, self.finish_reason, self.previous = "", None, None
        self.longest_stop = max(map(len, stops), default=0)

    def add(self, token: Token) -> tuple[str, Optional[dict]]:
        """The new text a client may see now (held back: a partial character, or what may
        be the start of a stop string), and this token's logprobs when asked."""
        self.tokens.append(token.id)
        self.finish_reason = token.finish_reason
        text = self.backend.decode(self.tokens)
        # What was sent had no stop in it: only a stop ending in the new text can start
        # within the last stop's length before it.
        since = max(0, len(self.sent) - self.longest_stop)
        cuts = [at for at in (text.find(s, since) for s in self.stops) if at >= 0]
        if cuts:
            text = text[: min(cuts)]
        elif self.finish_reason is None:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - max((_held(text, s) for s in self.stops), default=0)]
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent = self.sent + delta
        if not self.with_logprobs:
            return delta, None
        piece = self.spell(token.id)
        top = [(self.spell(t), lp) for t, lp in token.top]
        self.pieces.append(piece), self.logprobs.append(token.logprob), self.tops.append(top)
        return delta, {"pieces": [piece], "logprobs": [token.logprob], "tops": [top]}

    def as_dict(self, kind: str) -> dict:
        echo = self.echo
        logprobs = (
            logprobs_object(kind, echo.pieces + self.pieces, echo.logprobs + self.logprobs, echo.tops + self.tops) if self.with_logprobs else None
        )
        return {"index": self.index, "text": echo.text + self.sent, "logprobs": logprobs, "finish_reason": self.finish_reason}

    def echo_chunk(self, kind: str) -> tuple[str, Optional[dict]]:
        """What a stream sends first with `echo`: the prompt, and its logprobs when asked."""
        echo = self.echo
        return echo.text, logprobs_object(kind, echo.pieces, echo.logprobs, echo.tops) if self.with_logprobs else None


@dataclass(frozen=True)
class Echo:
    """A prompt as `echo` returns it: its text, and each token's text, log-probability
    (None for the first: nothing predicts it) and top alternatives."""

    text: str
    pieces: list[str]
    logprobs: list[Optional[float]]
    tops: list[Optional[list[tuple[str, float]]]]


NO_ECHO = Echo("", [], [], [])


def _held(text: str, stop: str) -> int:
    """How many of `text`'s last characters begin `stop` (a stop that may be completing)."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text[-n] == stop[0] and text.endswith(stop[:n]):
            return n
    return 0
