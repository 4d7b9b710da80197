"""The decoder, assembled from ``layers.py`` and ``moe.py`` by the architecture's ``ArchSpec``, in
the spirit of gpt-fast: Llama, Mistral, Qwen2, Qwen3, Gemma 3, Qwen3-MoE, Mixtral, DeepSeek-V3
(its attention in ``mla.py``, its experts in ``deepseek_moe.py``).

Module names mirror Hugging Face's (``layers.N.self_attn.q_proj``, ``mlp.down_proj``, ``lm_head``)
so checkpoints load by name and ``modules_to_not_convert`` patterns read as users expect.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from compiler.model.config import ModelConfig
from compiler.model.deepseek_moe import DeepseekMoE
from compiler.model.kv_cache import ContiguousKVCache, KVCache
from compiler.model.layers import MLP, Attention, ScaledEmbedding, make_norm, rope_inv_freq, rope_tables
from compiler.model.mla import MLAttention
from compiler.model.moe import SparseMoE

__all__ = ["DecoderLayer", "Transformer", "rope_inv_freq"]


class DecoderLayer(nn.Module):
    """Pre-norm attention then feed-forward, each added to the residual stream; with the
    architecture's ``sandwich_norms`` (Gemma) each sub-block's output is normalised too."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        spec = config.spec
        self.input_layernorm = make_norm(config)
        self.self_attn = (MLAttention if spec.attention == "mla" else Attention)(config, layer_idx)
        self.post_attention_layernorm = make_norm(config)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(config)
            self.post_feedforward_layernorm = make_norm(config)
        # Mixtral's checkpoints name the feed-forward block_sparse_moe; every other one mlp.
        self.ffn_name = "block_sparse_moe" if spec.ffn == "mixtral" else "mlp"
        moe = DeepseekMoE if spec.ffn == "deepseek_moe" else SparseMoE
        setattr(self, self.ffn_name, moe(config) if config.is_moe_layer(layer_idx) else MLP(config))

    @property
    def ffn(self) -> nn.Module:
        """The feed-forward (``mlp`` or ``block_sparse_moe``): an ``MLP`` or a ``SparseMoE``."""
        return getattr(self, self.ffn_name)

    def forward(self, x, cos, sin, positions, cache=None):
        if self.sandwich:
            h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, positions, cache))
            return h + self.post_feedforward_layernorm(self.ffn(self.pre_feedforward_layernorm(h)))
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, cache)
        return h + self.ffn(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    """The decoder. ``forward(input_ids[B, T]) -> logits[B, T, V]``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        embedding = ScaledEmbedding if config.spec.scale_embeddings else nn.Embedding
        self.embed_tokens = embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.n_layers))
        self.norm = make_norm(config)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)  # [R, D/2]

    def untie_lm_head(self) -> None:
        """Give a tied lm_head a weight of its own, a copy of the embedding's, so that a pass can change one
        without the other. The config is the caller's to update: the rotate pass unties it for good; AWQ's
        quantized head leaves it tied (the head's own module is then what the artifact stores)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = nn.Parameter(self.embed_tokens.weight.detach().clone(), requires_grad=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin: [B, R, T, D] for absolute positions [B, T] (computed in fp32); R = 1, or 2 where
        the sliding layers have their own base (Gemma 3)."""
        return rope_tables(self.inv_freq, positions, dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head: final norm, ``lm_head``, and the config's soft-capping if any. [..., dim] -> [..., V]."""
        logits = self.lm_head(self.norm(hidden))
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

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
        logits = self.logits(x)
        return (logits, hidden) if return_hidden else logits

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_ids: list[int] | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Greedy decoding of one or more equal-length prompts with a contiguous cache (the reference
        path); with a (CPU) ``generator``, sampling at temperature 1 instead."""
        c = self.config
        B, T = input_ids.shape
        p = next(self.parameters())
        heads, dim, values = c.kv_cache_layout
        cache = ContiguousKVCache(c.n_layers, B, T + max_new_tokens, heads, dim, p.dtype, p.device,
                                  c.sliding_windows, keys_only=not values)
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
