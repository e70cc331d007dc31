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


class UnitOffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by (1 + w), with w starting at 0, computed in fp32 and
    cast back after the scaling (Llama's casts before it)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def rms_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    return UnitOffsetRMSNorm(dim, cfg.norm_eps) if cfg.unit_offset_norms else nn.RMSNorm(dim, eps=cfg.norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int = 0):
        super().__init__()
        self.window = window  # > 0: each query sees only the last `window` positions up to its own
        self.scale = cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else None  # None: SDPA's head_dim**-0.5
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # Over each head's own features, so they hold under TP's split of the heads.
        self.q_norm = rms_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = rms_norm(cfg, cfg.head_dim) if cfg.qk_norm else None

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
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=self.scale)
        elif cache is None:
            mask = sliding_causal_mask(seq, self.window, q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=self.scale)
        else:  # keys and values of earlier calls, and which of them each query sees
            k, v = cache.update(k, v)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.mask_for(self.window), enable_gqa=True, scale=self.scale)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig, hidden: int = 0):
        super().__init__()
        hidden = hidden or cfg.ffn_hidden
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)
        self.gelu = cfg.activation == "gelu_tanh"  # GeGLU (Gemma), else SwiGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.gelu(self.w1(x), approximate="tanh") if self.gelu else F.silu(self.w1(x))
        return self.w2(gate * self.w3(x))


class MixtureOfExperts(nn.Module):
    """Qwen3-MoE's MLP: a router's softmax over all experts, each token's top
    `experts_per_token` (renormalized to sum to 1 if asked), and the weighted sum of
    those experts' SwiGLU outputs. The experts are ordinary parameters: FSDP shards
    them like any other; there is no expert parallelism."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.normalize = cfg.experts_per_token, cfg.normalize_top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(cfg, cfg.expert_ffn_hidden) for _ in range(cfg.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(tokens), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == index)
            if rows.numel():  # every expert still joins autograd's graph below (FSDP waits on its gradients)
                out.index_add_(0, rows, expert(tokens[rows]) * weights[rows, slot, None])
            else:
                out = out + 0 * expert(tokens[:1]).sum()
        return out.reshape(x.shape)


def sliding_causal_mask(seq: int, window: int, device: torch.device) -> torch.Tensor:
    """Query i sees keys j with i - window < j <= i."""
    distance = torch.arange(seq, device=device)[:, None] - torch.arange(seq, device=device)[None, :]
    return (distance >= 0) & (distance < window)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attention_norm = rms_norm(cfg, cfg.dim)
        self.attention = Attention(cfg, cfg.window_of(layer))
        self.ffn_norm = rms_norm(cfg, cfg.dim)
        self.feed_forward = MixtureOfExperts(cfg) if cfg.has_experts(layer) else FeedForward(cfg)
        # Gemma's: each branch's output normalized before it joins the residual stream.
        self.attention_out_norm = rms_norm(cfg, cfg.dim) if cfg.sandwich_norms else None
        self.ffn_out_norm = rms_norm(cfg, cfg.dim) if cfg.sandwich_norms else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        # A keyword: TP's input hooks describe the positional inputs only.
        attended = self.attention(self.attention_norm(x), cos, sin, cache=cache)
        x = x + (self.attention_out_norm(attended) if self.attention_out_norm is not None else attended)
        fed = self.feed_forward(self.ffn_norm(x))
        return x + (self.ffn_out_norm(fed) if self.ffn_out_norm is not None else fed)


def named_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator of its own for a parameter: every layout that holds the parameter
    (a pipeline stage, a TP rank before its split) draws the same values."""
    return torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed by index keeps parameter names stable when pipeline
        # stages delete the blocks they do not own.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = rms_norm(cfg, cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: recomputed on materialization, never checkpointed. The local
        # tables (Gemma 3's sliding layers' own RoPE base) exist only where asked for.
        for name, table in zip(("rope_cos", "rope_sin", "rope_local_cos", "rope_local_sin"), self._rope_tables()):
            self.register_buffer(name, table, persistent=False)

    def forward(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:
        """Logits (or a pipeline stage's activations). With a `cache`, `tokens` continue
        the sequences it holds, at the positions it gives."""
        # A pipeline stage is this module with the parts it does not own set to
        # None (and blocks removed), so the same forward serves every stage.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.tok_embeddings is not None and self.cfg.embed_scale:
            h = h * torch.tensor(self.cfg.dim**0.5, dtype=h.dtype)  # rounded to the weights' dtype first, as Gemma does
        rope, local_rope = (self.rope_cos, self.rope_sin), (self.rope_local_cos, self.rope_local_sin)
        has_local = self.rope_local_cos is not None
        if cache is not None:  # each sequence's own positions
            rope = tuple(table[cache.positions] for table in rope)
            local_rope = tuple(table[cache.positions] for table in local_rope) if has_local else local_rope
        for name, layer in self.layers.items():
            cos, sin = local_rope if has_local and layer.attention.window else rope
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
                param.fill_(0.0 if self.cfg.unit_offset_norms else 1.0)
                continue
            if name.endswith(".bias"):
                param.zero_()
                continue
            scale = residual_std if name.endswith(("attention.wo.weight", ".w2.weight")) else std  # the MLPs' (and experts') output
            param.copy_(torch.randn(param.shape, generator=named_generator(seed, name)) * scale)
        self.reset_rope()

    def _rope_tables(self) -> tuple:
        """(cos, sin, local cos, local sin); the local pair None unless `local_rope_theta`."""
        cfg = self.cfg
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        local = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.local_rope_theta) if cfg.local_rope_theta else (None, None)
        return cos, sin, *local

    def reset_rope(self) -> None:
        """Fill the RoPE tables, in fp32 whatever the weights' dtype (model files do not hold them)."""
        device = self.rope_cos.device
        for name, table in zip(("rope_cos", "rope_sin", "rope_local_cos", "rope_local_sin"), self._rope_tables()):
            setattr(self, name, table.to(device) if table is not None else None)
