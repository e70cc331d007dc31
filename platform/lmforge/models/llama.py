"""Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention;
Qwen2's q/k/v biases, Qwen3's per-head q/k norms and Llama 3's RoPE scaling as
switches of its `ModelConfig`.

A plain `nn.Module` in the nanoGPT/TorchTitan spirit: parallelism, checkpointing
and compilation are applied from outside by `lmforge.parallel`; generation passes
a KV cache (`lmforge.inference.kv_cache`) through the forward and nothing more.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.models.config import ModelConfig, RopeScaling


def rope_tables(head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv_freq = scaled_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def scaled_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """`linear`: every frequency divided by the factor. `llama3` (Llama 3.1's release):
    wavelengths longer than the original context / low_freq_factor are divided by
    the factor, those shorter than it / high_freq_factor kept, and the band between
    blended linearly in the context-to-wavelength ratio."""
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    wavelength = 2 * math.pi / inv_freq
    ratio = scaling.original_max_seq_len / wavelength
    blend = ((ratio - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0.0, 1.0)
    return (1 - blend) * inv_freq / scaling.factor + blend * inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]); x is (batch, seq, heads, head_dim), cos/sin are
    (seq, head_dim/2) or, for per-sequence positions, (batch, seq, head_dim/2)."""
    x_even, x_odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int = 0):
        super().__init__()
        self.window = window  # > 0: each query sees only the last `window` positions up to its own
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # Over each head's own features, so they hold under TP's split of the heads.
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 instead of the head count keeps this correct when TP shards the heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cache is None:
            # cos/sin cover max_seq_len; the sequence here may be longer than a
            # sequence-sharded block input, so slice at the attention itself.
            cos, sin = cos[:seq], sin[:seq]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is None and not self.window:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif cache is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=sliding_causal_mask(seq, self.window, q.device), enable_gqa=True)
        else:  # keys and values of earlier calls, and which of them each query sees
            k, v = cache.update(k, v)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.mask_for(self.window), enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def sliding_causal_mask(seq: int, window: int, device: torch.device) -> torch.Tensor:
    """Query i sees keys j with i - window < j <= i."""
    distance = torch.arange(seq, device=device)[:, None] - torch.arange(seq, device=device)[None, :]
    return (distance >= 0) & (distance < window)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg, cfg.window_of(layer))
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        # A keyword: TP's input hooks describe the positional inputs only.
        x = x + self.attention(self.attention_norm(x), cos, sin, cache=cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed by index keeps parameter names stable when pipeline
        # stages delete the blocks they do not own.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        # Not persistent: recomputed on materialization, never checkpointed.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:
        """Logits (or a pipeline stage's activations). With a `cache`, `tokens` continue
        the sequences it holds, at the positions it gives."""
        # A pipeline stage is this module with the parts it does not own set to
        # None (and blocks removed), so the same forward serves every stage.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = self.rope_cos, self.rope_sin
        if cache is not None:
            cos, sin = cos[cache.positions], sin[cache.positions]
        for name, layer in self.layers.items():
            h = layer(h, cos, sin, cache=cache.layer(int(name)) if cache is not None else None)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init, GPT-2 style with scaled residual projections.

        Each parameter draws from its own generator seeded by (seed, name), so a
        pipeline stage holding only some blocks gets exactly the values the whole
        model would have.
        """
        std = 0.02
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if name.endswith(".bias"):
                param.zero_()
                continue
            scale = residual_std if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else std
            gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
        self.reset_rope()

    def reset_rope(self) -> None:
        """Fill the RoPE tables, in fp32 whatever the weights' dtype (model files do not hold them)."""
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, self.cfg.rope_scaling)
        self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)
