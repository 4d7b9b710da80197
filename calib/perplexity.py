"""Perplexity over evaluation windows for any ``forward(input_ids[B, T]) -> logits[B, T, V]``."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F


@torch.no_grad()
def perplexity(forward: Callable[[torch.Tensor], torch.Tensor], windows: torch.Tensor, batch_size: int = 4) -> dict:
    """Return ``{"ppl", "tokens", "nll"}``: exp of the mean next-token NLL over all windows.

    Each window predicts its tokens 1..T-1 from its own prefix (no context carried across windows).
    A non-finite loss is an error, never a number.
    """
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        logits = forward(batch).float()  # [B, T, V]
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
        total_nll += nll.item()
        total_tokens += batch[:, 1:].numel()
    mean_nll = total_nll / total_tokens
    if not math.isfinite(mean_nll):
        raise FloatingPointError("perplexity is not finite: the model produced NaN or Inf logits")
    return {"ppl": math.exp(mean_nll), "tokens": total_tokens, "nll": mean_nll}
