"""Mixture-of-experts feed-forwards: a router Linear, top-k softmax routing, one Linear module per expert.

Each expert is its own set of ``nn.Linear`` modules, named as the HF checkpoints name them
(Qwen3-MoE ``mlp.experts.N.gate_proj``, Mixtral ``block_sparse_moe.experts.N.w1``), so weights
load by name and a pass can quantize, observe or skip each expert on its own. The router
(``gate``) is an ``nn.Linear`` too; a quantizing pass should leave it in float.

Routing (both architectures): probabilities = softmax(router logits) in fp32; each token goes to
its ``num_experts_per_tok`` most probable experts, weighted by those probabilities, renormalised
to sum to 1 when ``norm_topk_prob`` (always for Mixtral). Experts run only on the tokens routed
to them, as in transformers; for calibrating an expert the router starves, ``every_token_to``
makes chosen experts read every token of the layer (their outputs still count for the routed
tokens only, so the forward is the same function).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from compiler.model.config import ModelConfig
from compiler.model.layers import MLP


class MixtralExpert(nn.Module):
    """Mixtral's expert: w2(silu(w1(x)) * w3(x)) — the MLP under Mixtral's names."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, width = config.dim, config.moe_intermediate_size
        self.w1 = nn.Linear(d, width, bias=False)  # gate
        self.w2 = nn.Linear(width, d, bias=False)  # down
        self.w3 = nn.Linear(d, width, bias=False)  # up

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """``gate`` (router, [dim -> num_experts]) and ``experts`` (a ModuleList); ``forward(x[B, T, dim])``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k, self.normalize = config.num_experts_per_tok, config.norm_topk_prob
        # Qwen3-MoE casts the routing weights back to the model dtype; Mixtral keeps them in fp32.
        self.weights_in_model_dtype = config.spec.ffn == "qwen_moe"
        self.gate = nn.Linear(config.dim, config.num_experts, bias=False)
        # Experts that read every token in this forward (calibration of starved experts: every_token_to).
        self.every_token: frozenset[int] = frozenset()
        if config.spec.ffn == "mixtral":
            self.experts = nn.ModuleList(MixtralExpert(config) for _ in range(config.num_experts))
        else:
            self.experts = nn.ModuleList(MLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, dim] -> (weights [N, k], expert ids [N, k])."""
        logits = self.gate(x)  # [N, E]
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(-1, D)  # [N, dim]
        return run_experts(self.experts, flat, *self.route(flat), self.every_token).reshape(B, T, D)


def run_experts(experts: nn.ModuleList, flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                every_token: frozenset[int] = frozenset()) -> torch.Tensor:
    """Sum over each token's experts of weight * expert(token): flat [N, dim], weights and ids [N, k].
    The experts in ``every_token`` run on all N tokens (``every_token_to``); only their routed
    tokens' outputs count."""
    out = torch.zeros_like(flat)
    on_every_token = {e: experts[e](flat) for e in sorted(every_token)}  # [N, dim] each
    for e in ids.unique().tolist():  # ascending, and each expert's tokens by slot then token, as transformers
        slot, token_idx = torch.where(ids.T == e)
        y = on_every_token[e][token_idx] if e in on_every_token else experts[e](flat[token_idx])
        y = y * weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def router_names(config: ModelConfig) -> list[str]:
    """The full names of the model's routers (``ArchSpec.router`` in each MoE layer)."""
    return [f"layers.{i}.{config.spec.router}" for i in range(config.n_layers) if config.is_moe_layer(i)]


@contextmanager
def every_token_to(model: nn.Module, experts: dict[str, set[int]]) -> Iterator[None]:
    """Inside the ``with``, ``experts`` ({MoE module name in ``model``: expert indices}) read every token
    of their layer instead of only those routed to them, so that calibration hooks on their
    Linears see the whole layer's input; each token's output is unchanged (up to the last bits of
    a matmul over more rows). Any module running its experts through ``run_experts`` with its
    ``every_token`` attribute takes part (``SparseMoE``, ``DeepseekMoE``)."""
    moes = {name: model.get_submodule(name) for name in experts}
    try:
        for name, moe in moes.items():
            moe.every_token = frozenset(experts[name])
        yield
    finally:
        for moe in moes.values():
            moe.every_token = frozenset()
