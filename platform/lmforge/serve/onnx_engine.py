"""The replica's engine for an ONNX Runtime model (`lmforge serve --backend onnxruntime`):
each running sequence has its own onnxruntime-genai generator and KV cache, and a step
gives each its next token in turn. ONNX Runtime computes the logits; the torch engine's
sampler chooses from them, so seeds, logprobs, stop rules and grammars behave as they do
there, and what fails in one sequence ends it alone."""

from __future__ import annotations

from typing import Callable

import torch

from lmforge.inference.onnx_runtime import OnnxGenerator, OnnxRun
from lmforge.serve.engine import DecodeLoop, Sampler, Sequence, fail

CPU = torch.device("cpu")


class OnnxBatcher(DecodeLoop):
    def __init__(
        self,
        model: OnnxGenerator,
        eos_ids: frozenset[int],
        vocab: int,
        max_running: int,
        on_step: Callable[[int], None] = lambda n: None,
        on_prefill: Callable[[int, int], None] = lambda prompt, reused: None,
    ):
        super().__init__(max_running)
        self.model, self.on_step, self.on_prefill = model, on_step, on_prefill
        self.sampler = Sampler(eos_ids, vocab)
        self.runs: dict[int, OnnxRun] = {}  # by id(sequence)
        self._thread.start()

    def _admit(self) -> None:
        """Prefill waiting sequences while there is room, each sampling its first token."""
        while len(self.running) < self.max_running:
            seq = self._next_waiting()
            if seq is None:
                return
            try:
                self.on_prefill(len(seq.prompt), 0)
                self.sampler.first(seq, CPU)
                run = self.runs[id(seq)] = OnnxRun(self.model, seq.prompt, len(seq.prompt) + seq.params.max_new_tokens)
                done = self.sampler.take([seq], run.logits())[0]
            except Exception as err:  # noqa: BLE001 - this sequence's prefill, not the loop's
                done = fail(seq, err)
            if done:
                self._leave(seq)

    def _step(self) -> None:
        """The next token of every running sequence, one forward each."""
        for seq in [seq for seq in self.running if seq.cancelled]:
            self._leave(seq)
        if not self.running:
            return
        self.on_step(len(self.running))
        for seq in list(self.running):
            try:
                run = self.runs[id(seq)]
                run.append(seq.tokens[-1])
                done = self.sampler.take([seq], run.logits())[0]
            except Exception as err:  # noqa: BLE001 - this sequence's, not the others'
                done = fail(seq, err)
            if done:
                self._leave(seq)

    def _fail(self, err: Exception) -> None:
        for seq in list(self.running):
            fail(seq, err)
            self._leave(seq)

    def _leave(self, seq: Sequence) -> None:
        self.runs.pop(id(seq), None)
        with self._wake:
            self.running.remove(seq)
