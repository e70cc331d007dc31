"""A replica's generation engines, behind one interface (`submit`, `cancel`):

- `ContinuousBatcher`: one decode loop over a shared slot cache in its own thread;
  a sequence that arrives joins at the next step and a finished one leaves at once
  (iteration-level scheduling), with a bound on running sequences and a waiting queue.
  A prompt's beginning that a slot already holds (a shared system prompt, another
  choice of the same request) is copied, not computed again. With one slot it is the
  no-batching baseline.
- `RequestBatcher`: Ray Serve's `@serve.batch` gathers whole requests and runs each
  batch to its end (request-level batching), for comparison.

Each sequence's tokens are sampled from its own generator, so what it generates does
not depend on which others share its steps; and a sequence whose own settings fail
(seeding, sampling) ends alone, with an error token, while the others go on.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch

from lmforge.inference.adapters import adapter_rows
from lmforge.inference.generate import generate_ids
from lmforge.inference.sampling import SamplingParams, next_tokens
from lmforge.inference.slots import SlotCache

if TYPE_CHECKING:
    from lmforge.serve.structured import Constraint


@dataclass
class Token:
    """One generated token as a sequence's listener receives it."""

    id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens and their log-probabilities, when asked
    finish_reason: Optional[str] = None  # set on the sequence's last token: "stop" or "length"


@dataclass
class Sequence:
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[Token], None]  # called from the engine's thread
    seed: int = 0
    top_logprobs: int = 0
    stopped: Optional[Callable[[list[int]], bool]] = None  # a stop string was generated
    tokens: list[int] = field(default_factory=list)
    cancelled: bool = False
    slot: int = -1
    generator: Optional[torch.Generator] = None  # set when it starts: on the model's device
    seen: Optional[torch.Tensor] = None  # its tokens so far, for a repetition penalty
    constraint: Optional[Constraint] = None  # a grammar its tokens must follow (serve/structured.py)
    adapter: int = 0  # the LoRA adapter whose update its rows take (0: the base model; inference/adapters.py)


class Sampler:
    """The next token of each sequence from its logits, and when the sequence ends."""

    def __init__(self, eos_ids: frozenset[int], vocab: int):
        self.eos_ids, self.vocab = eos_ids, vocab

    def first(self, seq: Sequence, device: torch.device) -> None:
        seq.generator = torch.Generator(device).manual_seed(seq.seed)
        seq.seen = None
        if seq.params.repetition_penalty != 1.0:  # the only rule that looks at earlier tokens
            seq.seen = torch.zeros(1, self.vocab, dtype=torch.bool, device=device)
            seq.seen[0, seq.prompt] = True

    def take(self, seqs: list[Sequence], logits: torch.Tensor) -> list[bool]:
        """Sample each row of `logits` (rows, vocab) for its sequence and tell its
        listener; which sequences ended (a sequence whose sampling failed ends alone).
        Greedy rows take one argmax together."""
        logits = logits[:, : self.vocab].float()
        logprobs = logits.log_softmax(dim=-1)  # the model's own, reported whatever a grammar allows
        failed: dict[int, Exception] = {}
        constrained = [row for row, seq in enumerate(seqs) if seq.constraint is not None]
        if constrained:
            logits = logits.clone()
            for row in constrained:
                try:
                    logits[row].masked_fill_(~seqs[row].constraint.allowed(logits.device), float("-inf"))
                except Exception as err:  # noqa: BLE001 - this sequence's grammar, not the step's
                    failed[row] = err
        chosen = logits.argmax(dim=-1).tolist()
        for row, seq in enumerate(seqs):
            if row not in failed and (not seq.params.greedy or seq.seen is not None):
                try:
                    chosen[row] = int(next_tokens(logits[row : row + 1], seq.params, seq.seen, seq.generator)[0])
                except Exception as err:  # noqa: BLE001 - this sequence's settings, not the step's
                    failed[row] = err
            if row in failed:
                chosen[row] = 0
        chosen_logprobs = logprobs.gather(1, torch.tensor(chosen, device=logits.device)[:, None]).squeeze(1).tolist()
        return [
            fail(seq, failed[row]) if row in failed else self._tell_or_fail(seq, token, logprob, logprobs[row])
            for row, (seq, token, logprob) in enumerate(zip(seqs, chosen, chosen_logprobs))
        ]

    def _tell_or_fail(self, seq: Sequence, token: int, logprob: float, row_logprobs: torch.Tensor) -> bool:
        try:  # its stop check decodes its own tokens
            return self._tell(seq, token, logprob, row_logprobs)
        except Exception as err:  # noqa: BLE001 - this sequence's, not the step's
            return fail(seq, err)

    def _tell(self, seq: Sequence, token: int, logprob: float, row_logprobs: torch.Tensor) -> bool:
        top = []
        if seq.top_logprobs:
            values, ids = row_logprobs.topk(seq.top_logprobs)
            top = list(zip(ids.tolist(), values.tolist()))
        seq.tokens.append(token)
        if seq.seen is not None:
            seq.seen[0, token] = True
        complete = seq.constraint is not None and seq.constraint.accept(token)
        finish = None
        if complete or (seq.params.stop_at_eos and token in self.eos_ids) or (seq.stopped is not None and seq.stopped(seq.tokens)):
            finish = "stop"
        elif len(seq.tokens) >= seq.params.max_new_tokens:
            finish = "length"
        seq.emit(Token(token, logprob, top, finish))
        return finish is not None


def fail(seq: Sequence, err: Exception) -> bool:
    """End one sequence with an error token (its request answers 500; the others go on)."""
    seq.emit(Token(-1, 0.0, [], f"error: {type(err).__name__}: {err}"))
    return True


class DecodeLoop:
    """A decode loop in its own thread over sequences waiting and running: a sequence
    that arrives joins at the next step, a finished or cancelled one leaves. Engines
    say how a sequence starts (`_admit`) and how a step runs (`_step`)."""

    def __init__(self, max_running: int):
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="lmforge-decode", daemon=True)

    @property
    def counts(self) -> tuple[int, int]:
        """(running, waiting); a sequence being prefilled counts as running."""
        with self._wake:
            return len(self.running), len(self.waiting)

    def submit(self, seq: Sequence) -> None:
        with self._wake:
            self.waiting.append(seq)
            self._wake.notify()

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True  # it leaves at the next step

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    self._wake.wait_for(lambda: self.waiting or self.running)
                try:
                    self._admit()
                    if self.running:
                        self._step()
                except Exception as err:  # noqa: BLE001 - the loop must outlive one bad step
                    self._fail(err)

    def _next_waiting(self) -> Optional[Sequence]:
        """The next sequence to start, moved to running at once (`counts` never misses it)."""
        with self._wake:
            while self.waiting:
                seq = self.waiting.popleft()
                if not seq.cancelled:
                    self.running.append(seq)
                    return seq
        return None

    def _admit(self) -> None:
        raise NotImplementedError

    def _step(self) -> None:
        raise NotImplementedError

    def _fail(self, err: Exception) -> None:
        raise NotImplementedError


class ContinuousBatcher(DecodeLoop):
    def __init__(
        self,
        model,
        eos_ids: frozenset[int],
        vocab: int,
        max_running: int,
        on_step: Callable[[int], None] = lambda n: None,
        prefix_reuse: bool = True,
        on_prefill: Callable[[int, int], None] = lambda prompt, reused: None,
    ):
        super().__init__(max_running)
        self.model, self.on_step, self.on_prefill = model, on_step, on_prefill
        self.prefix_reuse = prefix_reuse
        self.device = next(model.parameters()).device
        self.sampler = Sampler(eos_ids, vocab)
        self.cache = SlotCache(model.cfg, max_running, model.cfg.max_seq_len, self.device)
        self.free = list(range(max_running))
        self.slot_adapter = [0] * max_running  # whose keys and values each slot holds: a prefix is reused under its own adapter only
        self._thread.start()

    def _fail(self, err: Exception) -> None:
        """A forward that every running sequence shared failed: end them all with an
        error; the loop serves the next ones."""
        for seq in self.running:
            fail(seq, err)
            self._leave(seq)
        self.running = []
        self.free = list(range(self.max_running))

    def _admit(self) -> None:
        """Prefill waiting sequences into free slots, each sampling its first token."""
        while self.free:
            seq = self._next_waiting()
            if seq is None:
                return
            reused = self._place(seq)
            try:  # a prefill is this sequence's alone: what fails in it ends it alone
                self.on_prefill(len(seq.prompt), reused)
                self.sampler.first(seq, self.device)
                logits = self._forward([seq], torch.tensor([seq.prompt[reused:]], device=self.device))
                done = self.sampler.take([seq], logits)[0]
            except Exception as err:  # noqa: BLE001
                done = fail(seq, err)
            if done:
                self._leave(seq)
                self.running.remove(seq)

    def _place(self, seq: Sequence) -> int:
        """Give `seq` a free slot holding the longest beginning of its prompt that any
        slot holds (copied there if another slot holds it); how many tokens that is.
        Without one, the slot freed longest ago: what was freed lately is kept longer."""
        alike = [slot for slot in range(self.max_running) if self.slot_adapter[slot] == seq.adapter]
        source, reused = self.cache.longest_prefix(seq.prompt, alike) if self.prefix_reuse else (-1, 0)
        seq.slot = source if source in self.free else self.free[0]
        self.free.remove(seq.slot)
        self.slot_adapter[seq.slot] = seq.adapter
        self.cache.reuse(seq.slot, source if reused else seq.slot, reused)
        return reused

    def _step(self) -> None:
        """One new token for every running sequence, in one forward."""
        self.running = [seq for seq in self.running if not (seq.cancelled and self._leave(seq))]
        if not self.running:
            return
        self.on_step(len(self.running))
        last = torch.tensor([[seq.tokens[-1]] for seq in self.running], device=self.device)
        logits = self._forward(self.running, last)
        ended = [seq for seq, done in zip(self.running, self.sampler.take(self.running, logits)) if done]
        for seq in ended:
            self._leave(seq)
        self.running = [seq for seq in self.running if seq not in ended]

    def _forward(self, seqs: list[Sequence], tokens: torch.Tensor) -> torch.Tensor:
        self.cache.begin([seq.slot for seq in seqs], tokens)
        with adapter_rows(self.model, [seq.adapter for seq in seqs]):
            logits = self.model(tokens, self.cache)[:, -1]
        self.cache.advance()
        return logits

    def _leave(self, seq: Sequence) -> bool:
        self.cache.free(seq.slot)
        self.free.append(seq.slot)
        return True


class RequestBatcher:
    """Whole requests batched by `@serve.batch`: a batch's sequences are prefilled
    together (left-padded) and run until the last of them ends; sequences with
    different sampling settings run one group after another."""

    def __init__(self, model, eos_ids: frozenset[int], vocab: int, max_batch: int, on_step: Callable[[int], None] = lambda n: None):
        from ray import serve

        self.model, self.eos_ids, self.vocab, self.on_step = model, eos_ids, vocab, on_step
        self.running = self.waiting = 0
        self._lock = threading.Lock()  # one batch on the model at a time
        self._batched = serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=0.01)(self._run)

    @property
    def counts(self) -> tuple[int, int]:
        return self.running, self.waiting

    def submit(self, seq: Sequence) -> None:
        """From the replica's event loop."""
        self.waiting += 1
        asyncio.get_running_loop().create_task(self._batched(seq))

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True  # a batch runs to its end; its tokens go nowhere

    async def _run(self, seqs: list[Sequence]) -> list[None]:
        self.waiting -= len(seqs)
        self.running += len(seqs)
        try:
            await asyncio.to_thread(self._generate, seqs)
        finally:
            self.running -= len(seqs)
        return [None] * len(seqs)

    def _generate(self, seqs: list[Sequence]) -> None:
        key = lambda seq: (repr(seq.params), seq.top_logprobs)
        with self._lock, torch.inference_mode():
            for _, group in itertools.groupby(sorted(seqs, key=key), key=key):
                group = list(group)
                self.on_step(len(group))
                stops = [seq.stopped for seq in group]
                top = group[0].top_logprobs
                try:
                    results = generate_ids(
                        self.model,
                        [seq.prompt for seq in group],
                        group[0].params,
                        self.eos_ids,
                        self.vocab,
                        stopped=(lambda row, tokens: stops[row] is not None and stops[row](tokens)),
                        row_seeds=[seq.seed for seq in group],
                        soft_targets=(top, 1.0) if top else None,
                    )
                except Exception as err:  # noqa: BLE001 - reported to the group's listeners
                    for seq in group:
                        seq.emit(Token(-1, 0.0, [], f"error: {type(err).__name__}: {err}"))
                    continue
                for seq, result in zip(group, results):
                    self._replay(seq, result)

    def _replay(self, seq: Sequence, result) -> None:
        last = len(result.tokens) - 1
        for i, (token, logprob) in enumerate(zip(result.tokens, result.logprobs)):
            seq.tokens.append(token)
            top = list(zip(result.top_ids[i].tolist(), result.top_logprobs[i].tolist())) if result.top_ids is not None else []
            seq.emit(Token(token, logprob, top, result.finish_reason if i == last else None))


def make_engine(mode: str, model, eos_ids: frozenset[int], vocab: int, max_running: int, metrics, prefix_reuse: bool = True):
    """`metrics`: the replica's `ServerMetrics`, told of each decode step and prefill."""
    if mode in ("continuous", "off"):
        slots = max_running if mode == "continuous" else 1
        return ContinuousBatcher(model, eos_ids, vocab, slots, metrics.batch, prefix_reuse, metrics.prefill)
    return RequestBatcher(model, eos_ids, vocab, max_running, metrics.batch)
