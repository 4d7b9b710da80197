"""The distillation loss: ``alpha·T²·KL(p_t‖p_s at T) + beta·MSE(h_t, h_s) + gamma·CE(labels)``.

With ``hidden_norm = "rms"`` (the default) both hidden states are divided by their own per-token
RMS before the MSE. Llama-family residual streams carry a few "massive activation" tokens whose
norm is hundreds of times the rest; on raw states those tokens dominate the MSE (on SmolLM2
0.1·MSE is 40–80× the KL), while the next layer only sees each token through RMSNorm, i.e. its
direction.

Every term is a mean per token (KL, CE) or per element (MSE, then averaged over the mapped layer
pairs), so the value does not depend on the batch size: that is what makes a data-parallel run over
equal shards equal a single process over the whole batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LossWeights:
    alpha: float = 1.0  # KL(teacher ‖ student)
    beta: float = 0.1  # MSE of hidden states at mapped layers
    gamma: float = 0.0  # cross-entropy on the next token
    temperature: float = 1.0
    hidden_norm: str = "rms"  # compare hidden states after a per-token RMS normalization ("none": raw)


def kl_per_token(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(p_t ‖ p_s) at ``temperature`` for each position: [B, T, V] x2 -> [B, T] (fp32)."""
    log_pt = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    log_ps = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return (log_pt.exp() * (log_pt - log_ps)).sum(-1)


def rms_normalized(h: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``h`` divided by its root-mean-square over the last dimension (RMSNorm without a weight)."""
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def normalized_mse(h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE of two hidden states after each token's RMS normalisation (compares directions)."""
    return F.mse_loss(rms_normalized(h), rms_normalized(target))


def next_token_ce(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting tokens 1..T-1 from their prefixes."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))


class HiddenProjections(nn.Module):
    """One learned linear map per mapped layer pair, from the student's width to the teacher's.

    Only built when widths differ; initialised to a truncated identity so that, where the student
    is a slice of the teacher, matching starts from "copy the shared dimensions".
    """

    def __init__(self, n_pairs: int, student_dim: int, teacher_dim: int):
        super().__init__()
        self.maps = nn.ModuleList(nn.Linear(student_dim, teacher_dim, bias=False) for _ in range(n_pairs))
        with torch.no_grad():
            for m in self.maps:
                m.weight.copy_(torch.eye(teacher_dim, student_dim))

    def forward(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return self.maps[i](h)


def distill_loss(weights: LossWeights, input_ids: torch.Tensor, teacher_logits: torch.Tensor, student_logits: torch.Tensor,
                 teacher_hidden: list[torch.Tensor], student_hidden: list[torch.Tensor],
                 layer_map: list[tuple[int, int]], projections: HiddenProjections | None = None) -> dict[str, torch.Tensor]:
    """``{"loss", "kl", "mse", "ce"}``; terms with a zero weight are still computed for the logs when cheap.

    ``layer_map`` pairs (student layer, teacher layer); hidden lists hold the residual stream after
    each layer ([B, T, D]).
    """
    zero = student_logits.new_zeros((), dtype=torch.float32)
    kl = kl_per_token(teacher_logits, student_logits, weights.temperature).mean() if weights.alpha else zero
    mse = zero
    if weights.beta and layer_map:
        terms = []
        for i, (s, t) in enumerate(layer_map):
            h = student_hidden[s].float()
            if projections is not None:
                h = projections(i, h)
            target = teacher_hidden[t].float()
            terms.append(normalized_mse(h, target) if weights.hidden_norm == "rms" else F.mse_loss(h, target))
        mse = torch.stack(terms).mean()
    ce = next_token_ce(student_logits, input_ids) if weights.gamma else zero
    loss = weights.alpha * weights.temperature ** 2 * kl + weights.beta * mse + weights.gamma * ce
    return {"loss": loss, "kl": kl.detach(), "mse": mse.detach(), "ce": ce.detach()}
