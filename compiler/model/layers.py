"""The decoder's building blocks: norms, RoPE, attention, the dense MLP, the embedding.

Module names mirror Hugging Face's (``self_attn.q_proj``, ``self_attn.q_norm``, ``mlp.down_proj``)
so checkpoints load by name. Every projection is a plain ``nn.Linear`` that a pass may swap for a
quantized module with the same ``forward(x) -> y``; attention hands K/V to an optional cache
object (see ``kv_cache.py``). Outside autograd, a float32 model on the CPU runs its norms, RoPE and
SwiGLU through the C++ kernels (``compiler/kernels/cpu_ext.py``: one op each instead of up to a dozen);
the torch code here is what they are tested against and what runs everywhere else.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from compiler.kernels.cpu_ext import cpu_kernels_for
from compiler.model.architectures import SLIDING
from compiler.model.config import ModelConfig
from compiler.model.kv_cache import KVCache, attention_mask, sdpa


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in fp32 as transformers does, cast back, then the weight."""

    weight_offset = 0.0  # the norm multiplies by (weight_offset + weight); a pass folding scales into it needs this

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_kernels_for(x)
        if ops is not None and self.weight.dtype is torch.float32:
            return ops.rms_norm(x, self.weight, self.eps, self.weight_offset)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: times (1 + weight), all in fp32, then cast (its weights are stored as offsets from 1)."""

    weight_offset = 1.0

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(config: ModelConfig, dim: int | None = None) -> RMSNorm:
    norm = GemmaRMSNorm if config.spec.norm_weight_offset else RMSNorm
    return norm(dim or config.dim, config.norm_eps)


class ScaledEmbedding(nn.Embedding):
    """Gemma's embedding: the looked-up rows times √dim (rounded to the weight dtype, as transformers does)."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__(vocab_size, dim)
        self.scale = dim ** 0.5

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(input_ids)
        return x * x.new_tensor(self.scale)


def _inv_freq(theta: float, head_dim: int, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [D/2] for one RoPE base, with linear or llama3 scaling when given."""
    d = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if not scaling:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(inv_freq, theta, d, scaling)
    factor, low, high = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, theta: float, d: int, scaling: dict) -> torch.Tensor:
    """YaRN (Peng et al. 2023) as transformers computes it: interpolated (/ factor) frequencies for
    the slow dimensions, the original ones for the fast, a linear ramp between ``beta_slow`` and
    ``beta_fast`` rotations over the original context. Its attention factor: ``mla.yarn_factors``."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns ``rotations`` times over old_len
        return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the original frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [R, D/2], one row per RoPE base: R = 1, or 2 with a local base (Gemma 3:
    row 0 the global layers', row 1 the sliding layers')."""
    rows = [_inv_freq(config.rope_theta, config.head_dim, config.rope_scaling)]
    if config.rope_local_theta is not None:
        rows.append(_inv_freq(config.rope_local_theta, config.head_dim, None))
    return torch.stack(rows)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [B, R, T, D] for absolute positions [B, T] and inverse frequencies [R, D/2] (fp32)."""
    freqs = positions[:, None, :, None].float() * inv_freq.float()[None, :, None, :]  # [B, R, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, 1, T, D] (the rotate-half convention of HF checkpoints)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        d, hd = config.dim, config.head_dim
        self.q_proj = nn.Linear(d, config.n_heads * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, config.n_kv_heads * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, config.n_kv_heads * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.n_heads * hd, d, bias=config.o_bias)
        if config.spec.qk_norm:
            self.q_norm, self.k_norm = make_norm(config, hd), make_norm(config, hd)
        self.sliding_window = config.sliding_windows[layer_idx]
        # Which RoPE table this layer reads: the local base's (1) in Gemma 3's sliding layers.
        local = config.rope_local_theta is not None and config.layer_types and config.layer_types[layer_idx] == SLIDING
        self.rope_index = 1 if local else 0
        # The cache's attention scales scores by head_dim ** -0.5; Gemma 3 wants query_pre_attn_scalar
        # ** -0.5, so q is pre-multiplied by the ratio (1 where they agree, as in Gemma 3 270M).
        scalar = config.query_pre_attn_scalar
        self.q_scale = 1.0 if scalar is None or scalar == hd else math.sqrt(hd / scalar)
        # Optional (k, v) -> (k, v) rounding of an FP8 or INT8 KV cache (compiler.formats.kv_quant): applied here,
        # before any cache, so cache-less evaluation sees the K/V a quantized cache would hold.
        self.kv_quant: nn.Module | None = None
        self.qkv_proj: nn.Module | None = None  # q, k and v side by side once the engine fuses them (fusion.py)

    def fuse_qkv(self, qkv_proj: nn.Module) -> None:
        """Replace q/k/v_proj by one module whose output is their outputs concatenated."""
        self.qkv_split = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = qkv_proj

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is not None:
            return self.qkv_proj(x).split(self.qkv_split, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x, cos, sin, positions, cache: KVCache | None):
        """x: [B, T, dim]; cos/sin: [B, R, T, D] (``rope_tables``); positions: [B, T]."""
        B, T, _ = x.shape
        hd = self.config.head_dim
        q, k, v = self.project_qkv(x)
        q = q.view(B, T, -1, hd).transpose(1, 2)  # [B, Hq, T, D]
        k = k.view(B, T, -1, hd).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(B, T, -1, hd).transpose(1, 2)
        if self.config.spec.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        r = self.rope_index
        cos, sin = cos[:, r : r + 1], sin[:, r : r + 1]  # [B, 1, T, D]
        ops = cpu_kernels_for(q)
        q, k = ops.rope_qk(q, k, cos, sin) if ops is not None else (apply_rope(q, cos, sin), apply_rope(k, cos, sin))
        if self.q_scale != 1.0:
            q = q * self.q_scale
        if self.kv_quant is not None:
            k, v = self.kv_quant(k, v)
        if cache is not None:
            out = cache.attend(self.layer_idx, q, k, v, positions)
        elif self.sliding_window is not None and T > self.sliding_window:
            out = sdpa(q, k, v, attention_mask(positions, positions, self.sliding_window))
        else:
            out = sdpa(q, k, v, None, causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    """The gated feed-forward: down(act(gate(x)) * up(x)) (SwiGLU, or GeGLU with gelu-tanh for Gemma)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        b, width = config.mlp_bias, intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.dim, width, bias=b)
        self.up_proj = nn.Linear(config.dim, width, bias=b)
        self.down_proj = nn.Linear(width, config.dim, bias=b)
        self.act = ACTIVATIONS[config.spec.activation]
        self.swiglu = config.spec.activation == "silu"
        self.gate_up_proj: nn.Module | None = None  # gate and up side by side once the engine fuses them (fusion.py)

    def fuse_gate_up(self, gate_up_proj: nn.Module) -> None:
        """Replace gate/up_proj by one module whose output is [gate(x), up(x)]."""
        del self.gate_proj, self.up_proj
        self.gate_up_proj = gate_up_proj

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        ops = cpu_kernels_for(gate) if self.swiglu else None
        return self.down_proj(ops.silu_mul(gate, up) if ops is not None else self.act(gate) * up)
