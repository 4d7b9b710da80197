"""Per-request sampling: greedy, temperature, top-k, top-p, from each request's own seeded generator.

Each request draws from its own ``torch.Generator`` seeded with its ``seed``, so its tokens
do not depend on what else shares the batch.
"""
from __future__ import annotations

import torch

from serving.types import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] (already divided by the temperature) with everything outside top-k / top-p set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from logits [V]."""
    if params.temperature == 0.0:
        return int(logits.argmax())
    logits = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
