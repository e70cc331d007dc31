"""Model shapes: a typed config and named presets (no torch import).

`tiny` is for tests, `small` for the quickstart; the 1B-70B Llama shapes exist
for planning and are never materialized on a CPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


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

    def __post_init__(self):
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} is {value!r}, not a positive whole number")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} is {value!r}, not a positive number")

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
    "1b": ModelConfig(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden=8192,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    "7b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000, ffn_hidden=11008, max_seq_len=4096),
    "13b": ModelConfig(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000, ffn_hidden=13824, max_seq_len=4096),
    "70b": ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000, ffn_hidden=28672, max_seq_len=4096),
}


def config_from_dict(values, where: str) -> ModelConfig:
    """A model section (lmforge's config.json, a checkpoint's state.json) as a shape;
    ValueError naming `where` for one that is not."""
    if not isinstance(values, dict):
        raise ValueError(f"{where}: the model section is not a JSON object")
    try:
        cfg = ModelConfig(**values)
    except TypeError as err:  # an unknown or missing field
        raise ValueError(f"{where}: the model section {str(err).removeprefix('ModelConfig.__init__() ')}") from None
    except ValueError as err:
        raise ValueError(f"{where}: model {err}") from None
    if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(f"{where}: model dim {cfg.dim}, n_heads {cfg.n_heads} and n_kv_heads {cfg.n_kv_heads}: each must divide the one before")
    return cfg
