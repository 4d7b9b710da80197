"""Held-out comparison of a student with its teacher: KL per token, top-1 agreement, perplexities."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from passes.distill.loss import kl_per_token


@torch.no_grad()
def teacher_logits(teacher, windows: torch.Tensor, batch_size: int = 4) -> list[torch.Tensor]:
    """The teacher's logits per batch of ``windows``, computed once and reused before and after training."""
    device = next(teacher.parameters()).device
    return [teacher(windows[i:i + batch_size].to(device)).float() for i in range(0, len(windows), batch_size)]


@torch.no_grad()
def compare_on_windows(teacher, student, windows: torch.Tensor, batch_size: int = 4,
                       reference: list[torch.Tensor] | None = None) -> dict:
    """Mean per-token KL(teacher ‖ student) at T=1, top-1 agreement and both perplexities on ``windows`` [N, T].

    KL and agreement count every position; perplexities predict tokens 1..T-1 (the calib protocol).
    A non-finite result is an error, never a number. ``reference``: the teacher's logits from ``teacher_logits``
    (with the same ``batch_size``); without it the teacher runs batch by batch beside the student.
    """
    was_training = student.training
    student.eval()
    device = next(student.parameters()).device
    kl_sum = agree = positions = 0.0
    nll_t = nll_s = 0.0
    predicted = 0
    try:
        for i, start in enumerate(range(0, len(windows), batch_size)):
            batch = windows[start:start + batch_size].to(device)
            t = reference[i] if reference is not None else teacher(batch).float()
            s = student(batch).float()
            kl_sum += kl_per_token(t, s).sum().item()
            agree += (t.argmax(-1) == s.argmax(-1)).sum().item()
            positions += batch.numel()
            targets = batch[:, 1:].reshape(-1)
            nll_t += F.cross_entropy(t[:, :-1].reshape(-1, t.shape[-1]), targets, reduction="sum").item()
            nll_s += F.cross_entropy(s[:, :-1].reshape(-1, s.shape[-1]), targets, reduction="sum").item()
            predicted += targets.numel()
    finally:
        student.train(was_training)
    result = {"kl": kl_sum / positions, "top1_agreement": agree / positions,
              "ppl_teacher": math.exp(nll_t / predicted), "ppl_student": math.exp(nll_s / predicted),
              "tokens": int(positions)}
    if not all(math.isfinite(v) for v in result.values()):
        raise FloatingPointError(f"held-out comparison is not finite ({result}): the student produced NaN or Inf logits")
    return result
