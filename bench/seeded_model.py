"""The benches' model when none is given: a preset with seeded weights and a BPE
tokenizer trained on standard-library sources, written as a model directory."""

from __future__ import annotations

from pathlib import Path

from lmforge.data.corpus import stdlib_files
from lmforge.data.tokenizer import EOS_TOKEN, tokenizer_files, train_bpe
from lmforge.models.build import build_model
from lmforge.models.config import ModelConfig
from lmforge.models.weights import write_model_dir


def seeded_model(out: Path, cfg: ModelConfig, fmt: str = "lmforge") -> Path:
    """`out`, holding `cfg` with seed-0 weights in `fmt` (lmforge or hf) and a 1k-token tokenizer."""
    tokenizer = train_bpe([Path(f).read_text(errors="replace") for f in stdlib_files()[:20]], 1024)
    files = tokenizer_files(tokenizer.to_str(), EOS_TOKEN, cfg.max_seq_len)
    write_model_dir(out, fmt, cfg, build_model(cfg, seed=0).state_dict(), eos_id=tokenizer.token_to_id(EOS_TOKEN), files=files)
    return out
