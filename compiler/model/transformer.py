"""One compact Llama-family decoder (Llama, Mistral, Qwen2), in the spirit of gpt-fast.

Module names mirror Hugging Face's (``layers.N.self_attn.q_proj``, ``mlp.down_proj``, ``lm_head``)
so checkpoints load by name and ``modules_to_not_convert`` patterns read as users expect. Every
projection is a plain ``nn.Linear`` that a pass may swap for a quantized module with the same
``forward(x) -> y``; attention hands K/V to an optional cache object (see ``kv_cache.py``).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from compiler.model.config import ModelConfig
from compiler.model.kv_cache import ContiguousKVCache, KVCache, attention_mask, sdpa


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as transformers does, then cast back before the weight.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2], with llama3 scaling when the config asks for it."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = config.rope_scaling
    if not sc:
        return inv_freq
    factor, low, high = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old_len = sc["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


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
        # Optional (k, v) -> (k, v) rounding of an FP8 KV cache (compiler.formats.fp8_kv): applied here,
        # before any cache, so cache-less evaluation sees the K/V a quantized cache would hold.
        self.kv_quant: nn.Module | None = None

    def forward(self, x, cos, sin, positions, cache: KVCache | None):
        B, T, _ = x.shape  # [B, T, dim]
        hd = self.config.head_dim
        q = self.q_proj(x).view(B, T, -1, hd).transpose(1, 2)  # [B, Hq, T, D]
        k = self.k_proj(x).view(B, T, -1, hd).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(B, T, -1, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_quant is not None:
            k, v = self.kv_quant(k, v)
        if cache is not None:
            out = cache.attend(self.layer_idx, q, k, v, positions)
        elif self.config.sliding_window is not None and T > self.config.sliding_window:
            out = sdpa(q, k, v, attention_mask(positions, positions, self.config.sliding_window))
        else:
            out = sdpa(q, k, v, None, causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        b = config.mlp_bias
        self.gate_proj = nn.Linear(config.dim, config.intermediate_size, bias=b)
        self.up_proj = nn.Linear(config.dim, config.intermediate_size, bias=b)
        self.down_proj = nn.Linear(config.intermediate_size, config.dim, bias=b)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, positions, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    """The decoder. ``forward(input_ids[B, T]) -> logits[B, T, V]``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin: [B, 1, T, D] for absolute positions [B, T] (computed in fp32)."""
        freqs = positions[..., None].float() * self.inv_freq.float()  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, return_hidden: bool = False):
        """Logits [B, T, V]; with ``return_hidden`` also the residual stream after each layer."""
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        hidden = []
        for layer in self.layers:
            x = layer(x, cos, sin, positions, cache)
            if return_hidden:
                hidden.append(x)
        logits = self.lm_head(self.norm(x))
        return (logits, hidden) if return_hidden else logits

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_ids: list[int] | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Greedy decoding of one or more equal-length prompts with a contiguous cache (the reference
        path); with a (CPU) ``generator``, sampling at temperature 1 instead."""
        c = self.config
        B, T = input_ids.shape
        p = next(self.parameters())
        cache = ContiguousKVCache(c.n_layers, B, T + max_new_tokens, c.n_kv_heads, c.head_dim, p.dtype, p.device,
                                  c.sliding_window)
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        logits = self(input_ids, positions, cache)
        out = input_ids
        for step in range(max_new_tokens):
            if generator is None:
                next_ids = logits[:, -1].argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(logits[:, -1].float(), -1).cpu()
                next_ids = torch.multinomial(probs, 1, generator=generator).to(input_ids.device)
            out = torch.cat([out, next_ids], dim=1)
            if eos_token_ids and B == 1 and next_ids.item() in eos_token_ids:
                break
            if step + 1 < max_new_tokens:
                logits = self(next_ids, torch.full((B, 1), T + step, device=input_ids.device), cache)
        return out
