"""The relative error every kernel and model check in the tests reports."""
from __future__ import annotations

import torch


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 on the CPU; NaN or inf anywhere gives inf, which never passes."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if not (torch.isfinite(got).all() and torch.isfinite(ref).all()):
        return float("inf")
    return float((got - ref).norm() / ref.norm())
