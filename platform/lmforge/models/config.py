"""Model shapes: a typed config and named presets (no torch import).

One decoder covers the Llama-like families; what differs per family is a small set
of switches here (`family`, `head_dim`, `qkv_bias`, `qk_norm`, `rope_scaling`,
`sliding_window`), each
documented in docs/job-file.md. `tiny` is for tests, `small` for the quickstart;
the 1B-70B shapes exist for planning and are never materialized on a CPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Literal, Optional

# The Hugging Face architectures one decoder with these switches represents exactly.
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "qwen3_moe")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x's rotary scaling (`llama3`), or positions stretched by `factor` (`linear`)."""

    kind: Literal["llama3", "linear"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __post_init__(self):
        if self.kind not in ("llama3", "linear"):
            raise ValueError(f"rope_scaling kind is {self.kind!r}, not llama3 or linear")
        if not self.factor > 0 or not 0 < self.low_freq_factor < self.high_freq_factor or self.original_max_seq_len < 1:
            raise ValueError("rope_scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and original_max_seq_len >= 1")


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
    family: str = "llama"  # the Hugging Face architecture it exports as
    head_dim: int = 0  # 0: dim // n_heads (Qwen3 and Mistral ship others)
    qkv_bias: bool = False  # q, k and v projections with biases (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each head's q and k before RoPE (Qwen3)
    rope_scaling: Optional[RopeScaling] = field(default=None)
    sliding_window: int = 0  # > 0: layers see only the last this many positions (Mistral v0.1, Qwen's option)
    full_attention_layers: tuple[int, ...] = ()  # with a sliding window: the layers that see every position
    # Gemma 3's parts:
    activation: str = "silu"  # the gated MLP's: silu (SwiGLU) or gelu_tanh (GeGLU)
    unit_offset_norms: bool = False  # RMSNorms scale by (1 + w), in fp32, w starting at 0
    sandwich_norms: bool = False  # a norm after attention and after the MLP too, before each joins the residual
    embed_scale: bool = False  # embeddings multiplied by sqrt(dim)
    query_pre_attn_scalar: float = 0.0  # > 0: attention scores scaled by its -1/2 power, not head_dim's
    local_rope_theta: float = 0.0  # > 0: the sliding-window layers' RoPE base (and no scaling there)
    # A mixture of experts (Qwen3-MoE): each token's MLP is the weighted sum of its top
    # experts' (softmax over all, then the top k, renormalized if asked).
    n_experts: int = 0  # 0: a dense MLP everywhere
    experts_per_token: int = 0
    expert_ffn_hidden: int = 0
    normalize_top_k: bool = False
    dense_layers: tuple[int, ...] = ()  # with experts: the layers that keep a dense MLP

    def __post_init__(self):
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} is {value!r}, not a positive whole number")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} is {value!r}, not a positive number")
        if self.family not in FAMILIES:
            raise ValueError(f"family is {self.family!r}, not one of {', '.join(FAMILIES)}")
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 0:
            raise ValueError(f"head_dim is {self.head_dim!r}, not a whole number (0: dim // n_heads)")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or self.sliding_window < 0:
            raise ValueError(f"sliding_window is {self.sliding_window!r}, not a whole number (0: none)")
        layers = tuple(self.full_attention_layers)
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.n_layers for i in layers):
            raise ValueError(f"full_attention_layers is {list(layers)}, not layer indices below n_layers {self.n_layers}")
        object.__setattr__(self, "full_attention_layers", layers)

        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation is {self.activation!r}, not silu or gelu_tanh")
        for name in ("query_pre_attn_scalar", "local_rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} is {value!r}, not a number >= 0 (0: not used)")

        for name in ("n_experts", "experts_per_token", "expert_ffn_hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} is {value!r}, not a whole number")
        if self.n_experts and not (0 < self.experts_per_token <= self.n_experts and self.expert_ffn_hidden > 0):
            raise ValueError("n_experts needs 0 < experts_per_token <= n_experts and expert_ffn_hidden > 0")
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))

    def has_experts(self, layer: int) -> bool:
        return self.n_experts > 0 and layer not in self.dense_layers

    def window_of(self, layer: int) -> int:
        """The sliding window of a layer's attention; 0: it sees every earlier position."""
        return 0 if layer in self.full_attention_layers else self.sliding_window

    def with_overrides(self, **overrides) -> "ModelConfig":
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if ("dim" in overrides or "n_heads" in overrides) and "head_dim" not in overrides and self.head_dim == self.dim // self.n_heads:
            overrides["head_dim"] = 0  # still derived from the new shape
        return replace(self, **overrides)

    def num_params(self) -> int:
        """Parameter count, computed from the shapes (matches the built module)."""
        d, h = self.dim, self.ffn_hidden
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = 2 * d * q + 2 * d * kv + (q + 2 * kv if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        block = attn + (4 if self.sandwich_norms else 2) * d
        moe = self.n_experts * 3 * d * self.expert_ffn_hidden + self.n_experts * d  # experts and their router
        mlps = sum(moe if self.has_experts(i) else 3 * d * h for i in range(self.n_layers))
        embed = self.vocab_size * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.n_layers * block + mlps + embed + head + d

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N plus attention (PaLM appendix B), N the weights
        that multiply: an untied input embedding is a lookup, not a matmul, and a
        token's unchosen experts do not multiply it."""
        idle_experts = sum(self.has_experts(i) for i in range(self.n_layers)) * (self.n_experts - self.experts_per_token)
        multiplying = (
            self.num_params() - (0 if self.tie_embeddings else self.vocab_size * self.dim) - idle_experts * 3 * self.dim * self.expert_ffn_hidden
        )
        return 6 * multiplying + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len

    def as_dict(self) -> dict:
        """The fields, without the switches left at their defaults (a plain Llama's
        config reads as it always has)."""
        values = asdict(self)
        defaults = {f.name: f.default for f in fields(self)}
        if values["head_dim"] == self.dim // self.n_heads:
            values.pop("head_dim")
        values["full_attention_layers"] = list(self.full_attention_layers)
        switches = ("family", "qkv_bias", "qk_norm", "rope_scaling", "sliding_window", "activation", "unit_offset_norms", "sandwich_norms")
        values["dense_layers"] = list(self.dense_layers)
        experts = ("n_experts", "experts_per_token", "expert_ffn_hidden", "normalize_top_k")
        for name in (*switches, "embed_scale", "query_pre_attn_scalar", "local_rope_theta", *experts):
            if values[name] == defaults[name]:
                values.pop(name)
        for name in ("full_attention_layers", "dense_layers"):
            if not values[name]:
                values.pop(name)
        return values


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


def _llama3(dim, n_layers, n_heads, ffn_hidden, tied, factor) -> ModelConfig:
    return ModelConfig(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, vocab_size=128256, ffn_hidden=ffn_hidden, max_seq_len=131072,
        rope_theta=500000.0, tie_embeddings=tied, rope_scaling=RopeScaling("llama3", factor, 1.0, 4.0, 8192),
    )  # fmt: skip


def _qwen(family, dim, n_layers, n_heads, n_kv_heads, ffn_hidden, tied, vocab=151936, head_dim=0, max_seq_len=32768) -> ModelConfig:
    return ModelConfig(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=vocab, ffn_hidden=ffn_hidden, max_seq_len=max_seq_len,
        norm_eps=1e-6, rope_theta=1000000.0, tie_embeddings=tied, family=family, head_dim=head_dim,
        qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
    )  # fmt: skip


def _gemma3(
    dim, n_layers, n_heads, n_kv_heads, ffn_hidden, head_dim, vocab=262208, window=1024, max_seq_len=131072, scaling=None, query_scalar=256.0
) -> ModelConfig:
    """Every sixth layer global (RoPE base 1e6, scaled on the larger models), the others
    sliding (base 1e4, unscaled)."""
    return ModelConfig(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=vocab, ffn_hidden=ffn_hidden, max_seq_len=max_seq_len,
        norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=scaling, tie_embeddings=True, family="gemma3_text", head_dim=head_dim, qk_norm=True,
        sliding_window=window, full_attention_layers=tuple(range(5, n_layers, 6)), activation="gelu_tanh", unit_offset_norms=True,
        sandwich_norms=True, embed_scale=True, query_pre_attn_scalar=query_scalar, local_rope_theta=10000.0,
    )  # fmt: skip


# The released models' shapes (their config.json), for `lmforge plan` before any download;
# tests/unit/test_model_families.py checks each count against the published one.
PRESETS |= {
    "llama-3.2-1b": _llama3(2048, 16, 32, 8192, tied=True, factor=32.0),
    "llama-3.2-3b": _llama3(3072, 28, 24, 8192, tied=True, factor=32.0),
    "llama-3.1-8b": _llama3(4096, 32, 32, 14336, tied=False, factor=8.0),
    "llama-3.1-70b": _llama3(8192, 80, 64, 28672, tied=False, factor=8.0),
    "qwen2.5-0.5b": _qwen("qwen2", 896, 24, 14, 2, 4864, tied=True),
    "qwen2.5-1.5b": _qwen("qwen2", 1536, 28, 12, 2, 8960, tied=True),
    "qwen2.5-3b": _qwen("qwen2", 2048, 36, 16, 2, 11008, tied=True),
    "qwen2.5-7b": _qwen("qwen2", 3584, 28, 28, 4, 18944, tied=False, vocab=152064),
    "qwen2.5-14b": _qwen("qwen2", 5120, 48, 40, 8, 13824, tied=False, vocab=152064),
    "qwen2.5-32b": _qwen("qwen2", 5120, 64, 40, 8, 27648, tied=False, vocab=152064),
    "qwen2.5-72b": _qwen("qwen2", 8192, 80, 64, 8, 29568, tied=False, vocab=152064),
    "qwen3-0.6b": _qwen("qwen3", 1024, 28, 16, 8, 3072, tied=True, head_dim=128, max_seq_len=40960),
    "qwen3-1.7b": _qwen("qwen3", 2048, 28, 16, 8, 6144, tied=True, head_dim=128, max_seq_len=40960),
    "qwen3-4b": _qwen("qwen3", 2560, 36, 32, 8, 9728, tied=True, head_dim=128, max_seq_len=40960),
    "qwen3-8b": _qwen("qwen3", 4096, 36, 32, 8, 12288, tied=False, head_dim=128, max_seq_len=40960),
    "qwen3-14b": _qwen("qwen3", 5120, 40, 40, 8, 17408, tied=False, head_dim=128, max_seq_len=40960),
    "qwen3-32b": _qwen("qwen3", 5120, 64, 64, 8, 25600, tied=False, head_dim=128, max_seq_len=40960),
    # Gemma 3's text models (the larger ones' language model: their vision tower is not counted).
    "gemma-3-1b": _gemma3(1152, 26, 4, 1, 6912, head_dim=256, vocab=262144, window=512, max_seq_len=32768),
    "gemma-3-4b": _gemma3(2560, 34, 8, 4, 10240, head_dim=256, scaling=RopeScaling("linear", 8.0)),
    "gemma-3-12b": _gemma3(3840, 48, 16, 8, 15360, head_dim=256, scaling=RopeScaling("linear", 8.0)),
    "gemma-3-27b": _gemma3(5376, 62, 32, 16, 21504, head_dim=128, scaling=RopeScaling("linear", 8.0), query_scalar=168.0),
    "qwen3-30b-a3b": ModelConfig(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        vocab_size=151936,
        ffn_hidden=6144,
        max_seq_len=40960,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        family="qwen3_moe",
        head_dim=128,
        qk_norm=True,
        n_experts=128,
        experts_per_token=8,
        expert_ffn_hidden=768,
        normalize_top_k=True,
    ),  # fmt: skip
    "mistral-7b": ModelConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=32768,
        ffn_hidden=14336,
        max_seq_len=32768,
        rope_theta=1000000.0,
        family="mistral",
    ),  # fmt: skip
}


def config_from_dict(values, where: str) -> ModelConfig:
    """A model section (lmforge's config.json, a checkpoint's state.json) as a shape;
    ValueError naming `where` for one that is not."""
    if not isinstance(values, dict):
        raise ValueError(f"{where}: the model section is not a JSON object")
    try:
        cfg = ModelConfig(**values)
    except TypeError as err:  # an unknown or missing field (of the model, or of its rope_scaling)
        raise ValueError(f"{where}: the model section {str(err).removeprefix('ModelConfig.__init__() ')}") from None
    except ValueError as err:
        raise ValueError(f"{where}: model {err}") from None
    if cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(f"{where}: model n_heads {cfg.n_heads} is not a multiple of n_kv_heads {cfg.n_kv_heads}")
    if "head_dim" not in values and cfg.dim % cfg.n_heads:
        raise ValueError(f"{where}: model dim {cfg.dim} is not a multiple of n_heads {cfg.n_heads} (or give head_dim)")
    return cfg
