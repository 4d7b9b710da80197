"""DeepSeek-V3's feed-forward in its mixture-of-experts layers: routed experts chosen by a grouped
sigmoid router, plus shared experts that every token goes through.

Routing (transformers' ``DeepseekV3TopkRouter``), in fp32: scores = sigmoid(x Wᵀ); the choice
adds ``e_score_correction_bias`` (a load-balancing bias, used for choosing only); experts fall
into ``n_group`` groups ranked by the sum of their two best biased scores; the best ``topk_group``
groups stay, and among their experts the top ``num_experts_per_tok`` by biased score are chosen.
The weights are the unbiased scores of the chosen experts, renormalised with ``norm_topk_prob``,
times ``routed_scaling_factor``.

The router (``mlp.gate``) holds its weight as a parameter of its own module, not an
``nn.Linear`` (as in the checkpoints): no pass takes it for a Linear to quantize, so it stays
float by construction. A pass that rescales its input (AWQ folding into
``post_attention_layernorm``) multiplies its weight's columns to match.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from compiler.model.config import ModelConfig
from compiler.model.layers import MLP
from compiler.model.moe import run_experts


class GroupedTopkRouter(nn.Module):
    """``weight`` [num_experts, dim] and the ``e_score_correction_bias`` [num_experts] buffer."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.in_features, self.out_features = config.dim, config.num_experts  # read by the calibration hooks
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.dim))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))
        self.top_k, self.normalize = config.num_experts_per_tok, config.norm_topk_prob
        self.n_group, self.topk_group, self.scale = config.n_group, config.topk_group, config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, dim] -> (weights [N, k] fp32, expert ids [N, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [N, E]
        choice = scores + self.e_score_correction_bias.float()
        N, E = choice.shape
        group_scores = choice.view(N, self.n_group, -1).topk(2, dim=-1)[0].sum(-1)  # [N, G]
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        expert_mask = group_mask[:, :, None].expand(N, self.n_group, E // self.n_group).reshape(N, E)
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class DeepseekMoE(nn.Module):
    """``gate`` (the router), ``experts`` (MLPs of moe_intermediate_size) and ``shared_experts``
    (one MLP n_shared_experts times as wide); ``forward(x[B, T, dim])``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = GroupedTopkRouter(config)
        self.experts = nn.ModuleList(MLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        # Routed experts that read every token in this forward (calibration of starved experts: every_token_to).
        self.every_token: frozenset[int] = frozenset()
        self.shared_experts = (MLP(config, config.moe_intermediate_size * config.n_shared_experts)
                               if config.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        out = run_experts(self.experts, flat, *self.gate(flat), self.every_token).reshape(B, T, D)
        return out if self.shared_experts is None else out + self.shared_experts(x)
