"""Model shapes: a typed config and named presets (no torch import).

`tiny` is for tests, `small` for the quickstart; the 1B-70B Llama shapes exist
for planning and are never materialized on a CPU.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden: int
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def with_overrides(self, **overrides) -> "ModelConfig":
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def num_params(self) -> int:
        """Parameter count, computed from the shapes (matches the built module)."""
        d, h = self.dim, self.ffn_hidden
        kv = self.n_kv_heads * self.head_dim
        attn = d * d * 2 + d * kv * 2
        block = attn + 3 * d * h + 2 * d
        embed = self.vocab_size * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.n_layers * block + embed + head + d

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N plus attention (PaLM appendix B), N the weights
        that multiply: an untied input embedding is a lookup, not a matmul."""
        multiplying = self.num_params() - (0 if self.tie_embeddings else self.vocab_size * self.dim)
        return 6 * multiplying + 12 * self.n_layers * self.dim * seq_len

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1024, ffn_hidden=172, max_seq_len=256),
    "small": ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=8192, ffn_hidden=344, max_seq_len=512),
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=8192, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True),
    "7b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000, ffn_hidden=11008, max_seq_len=4096),
    "13b": ModelConfig(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000, ffn_hidden=13824, max_seq_len=4096),
    "70b": ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000, ffn_hidden=28672, max_seq_len=4096),
}


def read_model_config(path: str | Path) -> tuple[str, ModelConfig]:
    """("lmforge" or "hf", the shape) of a model directory, from its config.json alone;
    ValueError naming the file."""
    from lmforge.models.hf_config import CONFIG, config_from_hf, is_hf_dir

    file = Path(path) / CONFIG
    if not file.is_file():
        raise ValueError(f"{path}: not a model directory (no {CONFIG})")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{file}: unreadable ({err})") from None
    if is_hf_dir(path):
        return "hf", config_from_hf(config, str(file))
    try:
        return "lmforge", ModelConfig(**config["model"])
    except (KeyError, TypeError) as err:
        raise ValueError(f"{file}: neither lmforge's nor Hugging Face's model config ({err})") from None
