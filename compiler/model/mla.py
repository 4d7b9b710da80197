"""DeepSeek-V3's multi-head latent attention (MLA; DeepSeek-AI, "DeepSeek-V2", 2024).

Per token x [dim]:

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))     [H, dn + dr]  (q_proj(x) when q_lora_rank = 0)
    c, kr  = kv_a_proj_with_mqa(x)                    [r], [dr]     split; c -> kv_a_layernorm
    k_nope, v = kv_b_proj(c)                          [H, dn], [H, dv]
    k      = (k_nope, RoPE(kr) shared by every head)  [H, dn + dr]

with r = kv_lora_rank, dn = qk_nope_head_dim, dr = qk_rope_head_dim (``config.head_dim``),
dv = v_head_dim. RoPE applies to the last dr channels of q and to kr only (decoupled RoPE);
DeepSeek's checkpoints rotate adjacent pairs (``rope_interleave``). Scores scale by
(dn + dr) ** -0.5, times yarn's mscale² when the RoPE is yarn with ``mscale_all_dim``.

What a cache stores is the latent, ``[c, RoPE(kr)]`` (r + dr values per token and layer), as
transformers does; attention expands it into K and V with kv_b_proj over the cached tokens
(``expand``). Against caching K and V (H * (dn + dr + dv) values) that is 71x less memory on
DeepSeek-V3 (576 against 40,960 values), paid for by running kv_b_proj over the whole context
at every step, which is also why the result equals the cache-less forward exactly: both run the
same kv_b_proj (float or quantized) on the same latent.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from compiler.model.config import ModelConfig
from compiler.model.kv_cache import KVCache, sdpa
from compiler.model.layers import RMSNorm, apply_rope

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def yarn_factors(scaling: dict | None) -> tuple[float, float]:
    """(RoPE attention factor, softmax-scale multiplier) of a yarn RoPE entry, as transformers
    applies them to DeepSeek-V3: cos/sin times the attention factor, scores times mscale²."""
    if not scaling or scaling["rope_type"] != "yarn":
        return 1.0, 1.0

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    score = mscale(factor, m_all) ** 2 if m_all else 1.0
    return float(attention_factor), score


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D] with pairs (x0, x1), (x2, x3), ... each rotated by one frequency; cos/sin:
    [B, 1, T, D] (``rope_tables``: the first half holds each pair's angle). The result is laid
    out de-interleaved, (rotated evens, rotated odds), as transformers does for q and k alike."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLAttention(nn.Module):
    """Multi-head latent attention; module names as DeepSeek-V3's checkpoints (``self_attn.q_a_proj``, ...)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        c, H = config, config.n_heads
        self.rank, self.nope, self.rope_dim, self.v_dim = c.kv_lora_rank, c.qk_nope_head_dim, c.head_dim, c.v_head_dim
        qk = self.nope + self.rope_dim
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(c.dim, c.q_lora_rank, bias=c.qkv_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(c.q_lora_rank, H * qk, bias=False)
        else:
            self.q_proj = nn.Linear(c.dim, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.dim, self.rank + self.rope_dim, bias=c.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, c.dim, bias=c.o_bias)
        self.rope_factor, score = yarn_factors(c.rope_scaling)
        # SDPA scales by (dn + dr) ** -0.5 already; q carries yarn's extra mscale² (1 without yarn).
        self.q_scale = score
        self.rotate = apply_rope_interleaved if c.rope_interleave else apply_rope
        self.kv_quant: nn.Module | None = None  # the FP8 KV rounding hook of Attention; MLA's latent cache takes none

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, dim] -> q [B, H, T, dn + dr], RoPE not yet applied."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.config.q_lora_rank else self.q_proj(x)
        return q.view(B, T, self.config.n_heads, -1).transpose(1, 2)

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [B, 1, L, r + dr] -> k [B, H, L, dn + dr], v [B, H, L, dv]."""
        B, _, L, _ = latent.shape
        c, k_rope = latent.split([self.rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c).view(B, L, self.config.n_heads, -1).transpose(1, 2)  # [B, H, L, dn + dv]
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        return torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1), v

    def forward(self, x, cos, sin, positions, cache: KVCache | None):
        """x: [B, T, dim]; cos/sin: [B, 1, T, dr] (``rope_tables``); positions: [B, T]."""
        B, T, _ = x.shape
        q_nope, q_rope = self.query(x).split([self.nope, self.rope_dim], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c).view(B, 1, T, self.rank)
        cos, sin = cos[:, :1], sin[:, :1]
        if self.rope_factor != 1.0:  # transformers scales cos and sin by yarn's attention factor
            cos, sin = cos * self.rope_factor, sin * self.rope_factor
        q_rope = self.rotate(q_rope, cos, sin)
        k_rope = self.rotate(k_rope.view(B, 1, T, self.rope_dim), cos, sin)
        q = torch.cat([q_nope, q_rope], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        latent = torch.cat([c, k_rope], dim=-1)  # [B, 1, T, r + dr]
        if cache is not None:
            out = cache.attend_latent(self.layer_idx, q, latent, positions, self.expand)
        else:
            k, v = self.expand(latent)
            out = sdpa(q, k, v, None, causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))  # out: [B, H, T, dv]
