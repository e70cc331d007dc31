"""Graph-optimised inference with ONNX Runtime: `lmforge export --format onnx` turns any
model lmforge opens into onnxruntime-genai's model directory (its model builder, run
on the Hugging Face export, fp32 or int4 for CPU), and `OnnxGenerator` generates from
one (`lmforge generate --backend onnxruntime`); `OnnxRun` is one sequence's forward
for the server's ONNX engine. onnxruntime-genai is the optional extra `onnx`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from tokenizers import Tokenizer

from lmforge.checkpoint.export import ExportResult, export_model, open_source
from lmforge.errors import UserError
from lmforge.inference.generate import Generation
from lmforge.inference.sampling import SamplingParams
from lmforge.models.hf_config import ARCHITECTURES

PRECISIONS = ("fp32", "int4")  # what the builder makes for CPU
# The families lmforge exports that onnxruntime-genai's builder builds (not Qwen3-MoE).
BUILT_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")
GENAI_CONFIG = "genai_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # the export's, as lmforge encodes
EXTRA = "pip install 'lmforge[onnx]'"


def is_onnx_model(path: str | Path) -> bool:
    return (Path(path) / GENAI_CONFIG).is_file()


def export_onnx(source: str, out: str, precision: str = "fp32", tokenizer: Optional[str] = None, timeout_s: float = 3600) -> ExportResult:
    """The source exported as Hugging Face weights, then built by onnxruntime-genai's
    model builder; `out` appears only when the build succeeded."""
    if precision not in PRECISIONS:
        raise UserError(f"--dtype: {precision!r} is not one ONNX Runtime builds for CPU ({', '.join(PRECISIONS)})")
    _genai()
    target = Path(out)
    if target.exists():
        raise UserError(f"--out: {out} already exists")
    family = open_source(source, tokenizer, name="CHECKPOINT").cfg.family
    if family not in BUILT_FAMILIES:
        raise UserError(f"--format onnx: ONNX Runtime's model builder does not build {ARCHITECTURES.get(family, family)}; export --format hf instead")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.onnx-", dir=target.parent))  # this export's own, removed after
    try:
        result = export_model(source, staging / "hf", "hf", tokenizer=tokenizer)
        hf = staging / "hf"
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(hf), "-i", str(hf), "-o", str(staging / "onnx")]
        command += ["-p", precision, "-e", "cpu", "-c", str(staging / "cache")]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            architecture = json.loads((hf / "config.json").read_text())["architectures"][0]
            last = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["(no message)"]
            raise UserError(f"--format onnx: ONNX Runtime's model builder cannot build {architecture} ({last[0].strip()[:300]})")
        # The builder saves the tokenizer again through transformers, which rebuilds a
        # family's own (Qwen2's pre-tokenizer and NFC): text would encode differently.
        for name in TOKENIZER_FILES:
            if (hf / name).is_file():
                shutil.copyfile(hf / name, staging / "onnx" / name)
        (staging / "onnx").rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result.model_copy(update={"out": str(target), "format": "onnx"})


def check_onnx_model(path: str):
    """onnxruntime-genai, once a directory proves to be its model with a tokenizer."""
    og = _genai()
    if not is_onnx_model(path):
        raise UserError(f"MODEL: {path} is not an ONNX Runtime model directory (no {GENAI_CONFIG}); make one with lmforge export --format onnx")
    if not (Path(path) / "tokenizer.json").is_file():
        raise UserError(f"MODEL: {path} has no tokenizer.json beside its ONNX model")
    return og


class OnnxGenerator:
    """A model directory onnxruntime-genai built, and its tokenizer: greedy tokens are
    lmforge's own for fp32 (tested); sampling is ONNX Runtime's, with its own seeds."""

    def __init__(self, path: str):
        og = check_onnx_model(path)
        self.og, self.model = og, og.Model(str(path))
        self.tokenizer = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        search = json.loads((Path(path) / GENAI_CONFIG).read_text())["model"]
        self.context = int(search.get("context_length", 0)) or None
        eos = search.get("eos_token_id", [])
        self.eos_ids = frozenset(eos if isinstance(eos, list) else [eos])
        self.vocab_size = int(search.get("vocab_size", 0)) or self.tokenizer.get_vocab_size()

    def generate(self, prompts: list[str], params: SamplingParams) -> list[Generation]:
        params.check()
        return [self._one(prompt, params) for prompt in prompts]

    def _one(self, prompt: str, params: SamplingParams) -> Generation:
        ids = self.tokenizer.encode(prompt).ids
        if not ids:
            raise UserError("prompt: an empty prompt; give at least one token of text")
        if self.context and len(ids) + params.max_new_tokens > self.context:
            raise UserError(
                f"prompt: {len(ids)} prompt tokens and max_new_tokens {params.max_new_tokens} exceed the model's context of {self.context}"
            )
        settings = self.og.GeneratorParams(self.model)
        search = {"max_length": len(ids) + params.max_new_tokens, "do_sample": not params.greedy}
        if not params.greedy:
            search |= {"temperature": params.temperature, "top_k": params.top_k or 0, "top_p": params.top_p}
            search |= {"random_seed": params.seed} if params.seed is not None else {}
        settings.set_search_options(**search)
        generator = self.og.Generator(self.model, settings)
        generator.append_tokens(ids)
        result = Generation()
        while not generator.is_done():
            generator.generate_next_token()
            token = int(generator.get_next_tokens()[0])
            result.tokens.append(token)
            text = self.tokenizer.decode(result.tokens, skip_special_tokens=True)
            if token in self.eos_ids or any(stop in text for stop in params.stop):
                result.finish_reason = "stop"
                break
        text = self.tokenizer.decode(result.tokens, skip_special_tokens=True)
        cuts = [text.find(stop) for stop in params.stop if stop in text]
        result.text = text[: min(cuts)] if cuts else text
        return result


class OnnxRun:
    """One sequence on ONNX Runtime as a forward with its own KV cache: tokens in, the
    next token's logits out; the caller chooses each token (lmforge's sampler, grammar
    and stop rules) and appends it."""

    def __init__(self, generator: OnnxGenerator, prompt: list[int], capacity: int):
        settings = generator.og.GeneratorParams(generator.model)
        settings.set_search_options(max_length=capacity)
        self.run = generator.og.Generator(generator.model, settings)
        self.run.append_tokens(prompt)

    def append(self, token: int) -> None:
        self.run.append_tokens([token])

    def logits(self) -> torch.Tensor:
        """The next token's logits, [1, the model's vocabulary]."""
        return torch.from_numpy(np.asarray(self.run.get_logits(), dtype=np.float32).reshape(1, -1))


def prompt_logits(generator: OnnxGenerator, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocabulary]: the logits after each prompt token but the last,
    one cached forward per token (ONNX Runtime returns the last position's)."""
    run = OnnxRun(generator, prompt[:1], len(prompt))
    rows = [run.logits()]
    for token in prompt[1:-1]:
        run.append(token)
        rows.append(run.logits())
    return torch.cat(rows)


def timed_decode(generator: OnnxGenerator, prompt: str, tokens: int) -> float:
    """Seconds for `tokens` greedy tokens after `prompt`, end-of-text ignored (the bench)."""
    ids = generator.tokenizer.encode(prompt).ids
    settings = generator.og.GeneratorParams(generator.model)
    settings.set_search_options(max_length=len(ids) + tokens, min_length=len(ids) + tokens, do_sample=False)
    began = time.perf_counter()
    run = generator.og.Generator(generator.model, settings)
    run.append_tokens(ids)
    while not run.is_done():
        run.generate_next_token()
    seconds = time.perf_counter() - began
    if len(run.get_sequence(0)) != len(ids) + tokens:
        raise RuntimeError(f"ONNX Runtime stopped after {len(run.get_sequence(0)) - len(ids)} of {tokens} tokens")
    return seconds


def _genai():
    try:
        import onnxruntime_genai
    except ImportError:
        raise UserError(f"ONNX Runtime is not installed here: {EXTRA}") from None
    return onnxruntime_genai
