"""Batched generation: prefill the left-padded prompts into a KV cache, then decode
one token per sequence per step until each meets an end-of-text token, a stop
string or `max_new_tokens`.

`generate_ids` works on token ids (what distillation and serving call);
`Generator` adds a tokenizer and loads any model lmforge can open.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from tokenizers import Tokenizer

from lmforge.checkpoint.export import open_source
from lmforge.data.tokenizer import beyond_the_model, end_of_text_token
from lmforge.errors import UserError
from lmforge.inference.kv_cache import KVCache
from lmforge.inference.sampling import SamplingParams, next_tokens
from lmforge.models.build import build_model
from lmforge.models.hf import DTYPES
from lmforge.models.llama import Transformer
from lmforge.models.quantized import is_quantized, load_quantized


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)  # new tokens, an end-of-text token included
    logprobs: list[float] = field(default_factory=list)  # of each under the model (temperature 1, no penalty)
    finish_reason: str = "length"  # "stop": an end-of-text token or a stop string
    text: str = ""
    # With `soft_targets=(k, T)`: at each new token's position, the model's k most likely
    # tokens and their log-probabilities at temperature T, most likely first ([tokens, k]).
    top_ids: Optional[torch.Tensor] = None
    top_logprobs: Optional[torch.Tensor] = None

    def as_dict(self) -> dict:
        return {"text": self.text, "tokens": self.tokens, "logprobs": self.logprobs, "finish_reason": self.finish_reason}


def _forward(model: Transformer, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """The next-token logits (batch, vocab) after `tokens`, which continue the cache."""
    cache.begin(tokens.shape[1])
    logits = model(tokens, cache)
    cache.advance()
    return logits[:, -1]


def _sample(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor, generator, row_generators) -> torch.Tensor:
    """The next token of each row: from one generator for the batch, or (`row_generators`)
    each row from its own, so that a row's tokens do not depend on its batch."""
    if row_generators is None or params.greedy:
        return next_tokens(logits, params, seen, generator)
    return torch.cat([next_tokens(logits[row : row + 1], params, seen[row : row + 1], g) for row, g in enumerate(row_generators)])


@torch.no_grad()
def generate_ids(
    model: Transformer,
    prompts: list[list[int]],
    params: SamplingParams,
    eos_ids: frozenset[int] = frozenset(),
    vocab: Optional[int] = None,
    use_cache: bool = True,
    stopped: Optional[Callable[[int, list[int]], bool]] = None,
    row_seeds: Optional[list[int]] = None,
    soft_targets: Optional[tuple[int, float]] = None,
    go_on: Optional[Callable[[bool], bool]] = None,
) -> list[Generation]:
    """`vocab`: the tokenizer's real size (a model's padded rows never sampled);
    `use_cache=False` recomputes the whole sequence each step (the baseline the cache
    is measured against); `stopped(row, new_tokens)` ends a row early (stop strings);
    `row_seeds`: a seed per row instead of `params.seed`; `soft_targets` (k, T): keep
    the top k at each new token's position (distillation's soft targets); `go_on`:
    given whether a row still runs here, whether to take another step (a sharded model's
    ranks must all run the same forwards)."""
    cfg, param = model.cfg, next(model.parameters())
    device, vocab = param.device, vocab or cfg.vocab_size
    batch, longest = len(prompts), max(len(p) for p in prompts)
    total = longest + params.max_new_tokens
    if total > cfg.max_seq_len:  # the rotary tables end there
        raise ValueError(f"{longest} prompt tokens and {params.max_new_tokens} new exceed the model's context of {cfg.max_seq_len}")
    pad = torch.tensor([longest - len(p) for p in prompts])
    tokens = torch.zeros(batch, total, dtype=torch.long, device=device)
    seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, longest - len(prompt) : longest] = torch.tensor(prompt)
        seen[row, prompt] = True
    generator = torch.Generator(device).manual_seed(params.seed) if params.seed is not None else None
    row_generators = None if row_seeds is None else [torch.Generator(device).manual_seed(seed) for seed in row_seeds]
    tops: list[tuple[torch.Tensor, torch.Tensor]] = []

    def new_cache(capacity: int) -> KVCache:
        return KVCache(cfg, pad, capacity, device)

    cache = new_cache(total)
    logits = _forward(model, tokens[:, :longest], cache)
    out = [Generation() for _ in prompts]
    running = set(range(batch))
    for step in range(params.max_new_tokens):
        logits = logits[:, :vocab].float()
        chosen = _sample(logits, params, seen, generator, row_generators)
        logprobs = logits.log_softmax(dim=-1).gather(-1, chosen[:, None]).squeeze(-1)
        if soft_targets is not None:
            k, temperature = soft_targets
            values, ids = (logits / temperature).log_softmax(dim=-1).topk(k, dim=-1)
            tops.append((ids, values))
        for row, token, logprob in zip(range(batch), chosen.tolist(), logprobs.tolist()):
            if row not in running:
                continue
            out[row].tokens.append(token)
            out[row].logprobs.append(logprob)
            if (params.stop_at_eos and token in eos_ids) or (stopped is not None and stopped(row, out[row].tokens)):
                out[row].finish_reason = "stop"
                running.discard(row)
        if not (go_on(bool(running)) if go_on else running) or step == params.max_new_tokens - 1:
            break
        position = longest + step
        tokens[:, position] = chosen
        seen[torch.arange(batch), chosen] = True
        if use_cache:
            logits = _forward(model, chosen[:, None], cache)
        else:
            logits = _forward(model, tokens[:, : position + 1], new_cache(position + 1))
    if tops:
        ids, values = (torch.stack(part, dim=1).cpu() for part in zip(*tops))  # [batch, steps, k]
        for row, result in enumerate(out):
            result.top_ids, result.top_logprobs = ids[row, : len(result.tokens)], values[row, : len(result.tokens)]
    return out


def stop_checker(tokenizer: Tokenizer, stop: list[str]) -> Callable[[int, list[int]], bool]:
    """`stopped(row, new_tokens)`: whether a row's new tokens hold one of the stop strings."""

    def stopped(row: int, tokens: list[int]) -> bool:
        # Only the last tokens can complete a stop string that was not there before (a
        # character is at most 4 byte-level tokens).
        tail = tokenizer.decode(tokens[-(4 * max(map(len, stop)) + 4) :])
        return any(s in tail for s in stop)

    return stopped


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class Generator:
    """A model and its tokenizer, ready to answer text prompts."""

    def __init__(self, model: Transformer, tokenizer, eos_ids: frozenset[int]):
        self.model, self.tokenizer, self.eos_ids = model.eval(), tokenizer, eos_ids

    @classmethod
    def load(cls, path: str, device: str = "cpu", dtype: str = "fp32", tokenizer: Optional[str] = None) -> "Generator":
        """Any model lmforge opens: a committed checkpoint, an lmforge export, a Hugging
        Face directory, a quantized directory (`lmforge quantize`)."""

        if dtype not in DTYPES:
            raise UserError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
        if is_quantized(Path(path)):
            return cls._load_quantized(Path(path), device, dtype, tokenizer)
        source = open_source(path, tokenizer)
        if source.tokenizer_json is None:
            raise UserError(f"MODEL: {path} has no tokenizer to turn prompts into tokens; pass --tokenizer tokenizer.json")
        model = build_model(source.cfg, device, weights=source.read_tensors()).to(DTYPES[dtype])
        model.reset_rope()  # `.to` cast the RoPE tables too: back to fp32
        tok = source.tokenizer()
        return cls(model, tok, frozenset({tok.token_to_id(source.eos_token)}))

    @classmethod
    def _load_quantized(cls, path: Path, device: str, dtype: str, tokenizer: Optional[str]) -> "Generator":
        if dtype != "fp32":
            raise UserError(f"--dtype: a quantized model computes in fp32 here; {dtype} is for unquantized models")
        tokenizer_file = Path(tokenizer) if tokenizer else path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise UserError(f"MODEL: {path} has no tokenizer.json; pass --tokenizer tokenizer.json")
        name = "--tokenizer" if tokenizer else "MODEL"
        try:
            tok = Tokenizer.from_file(str(tokenizer_file))
        except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
            raise UserError(f"{name}: {tokenizer_file} is not a tokenizer.json ({str(err).splitlines()[0]})") from None
        model = load_quantized(path, device)
        beyond = beyond_the_model(tok, model.cfg.vocab_size)
        if beyond:
            raise UserError(f"{name}: {tokenizer_file} {beyond}")
        return cls(model, tok, frozenset({tok.token_to_id(end_of_text_token(tokenizer_file))}))

    def encode(self, prompt: str, params: SamplingParams, name: str = "prompt", special_tokens: bool = True) -> list[int]:
        """`special_tokens`: add the tokenizer's own (a BOS, say); False for a rendered
        chat, which holds those its template writes."""
        ids = self.tokenizer.encode(prompt, add_special_tokens=special_tokens).ids
        context = self.model.cfg.max_seq_len
        if not ids:
            raise UserError(f"{name}: an empty prompt; give at least one token of text")
        if len(ids) + params.max_new_tokens > context:
            raise UserError(
                f"{name}: {len(ids)} prompt tokens and max_new_tokens {params.max_new_tokens} exceed the model's context of {context} tokens"
            )
        return ids

    def generate(self, prompts: list[str], params: SamplingParams, names: Optional[dict] = None, chats: bool = False) -> list[Generation]:
        """`chats`: the prompts are rendered chats (see `lmforge.chat.ChatTemplate`)."""
        params.check(names)
        prompt_ids = [self.encode(p, params, (names or {}).get("prompt", "prompt"), special_tokens=not chats) for p in prompts]
        stopped = self.stop_checker(params.stop) if params.stop else None
        results = generate_ids(self.model, prompt_ids, params, self.eos_ids, self.tokenizer.get_vocab_size(), stopped=stopped)
        for result in results:
            result.text = self._text(result.tokens, params.stop)
        return results

    def stop_checker(self, stop: list[str]) -> Callable[[int, list[int]], bool]:
        return stop_checker(self.tokenizer, stop)

    def _text(self, tokens: list[int], stop: list[str]) -> str:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cuts = [text.find(s) for s in stop if s in text]
        return text[: min(cuts)] if cuts else text
