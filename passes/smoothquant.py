"""SmoothQuant's channel smoothing (Xiao et al., ICML 2023) before FP8 activation scales.

A few input channels of a decoder Linear carry values tens to hundreds of times larger than the
rest; one FP8 scale per token (or per tensor) is set by them, and the other channels are rounded
into the format's subnormals. Dividing channel j of the input by s_j and multiplying the
consumers' weight column j by s_j leaves the float model unchanged; with
s_j = max|x_j|^α / max|w_j|^(1-α) the activation outliers move part of the way (α) into the
weights, which quantize per output row and absorb them better. The division is folded into the
module producing the input (an RMSNorm's weight, or ``v_proj``/``up_proj``'s output rows), so
nothing runs at inference time. Groups are AWQ's (``awq_plan.SCALING_GROUPS``).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from passes.awq_plan import SCALING_GROUPS, consumer_columns_to_channels, fold_scales


def smoothing_scales(x_amax: torch.Tensor, w_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = max|x|^α / max|w|^(1-α) per channel; channels never active (or all-zero weights) keep 1."""
    s = x_amax.float().pow(alpha) / w_amax.float().pow(1 - alpha)
    return torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s)).clamp(1e-5, 1e5)


@torch.no_grad()
def smooth_model(model: nn.Module, input_amax: dict[str, torch.Tensor], alpha: float) -> list[str]:
    """Smooth every scaling group whose Linears all have an entry in ``input_amax`` (name -> per
    input channel abs-max over the calibration tokens) and are still float; returns the groups done."""
    config = model.config
    done = []
    for i, block in enumerate(model.layers):
        prefix = f"layers.{i}."
        for group in SCALING_GROUPS[config.architecture]:
            names = [prefix + n for n in group.linears]
            linears = [block.get_submodule(n) for n in group.linears]
            if not all(n in input_amax and type(m) is nn.Linear for n, m in zip(names, linears)):
                continue  # a consumer left in float or claimed by another pass: its weights must not move
            prev = block.get_submodule(group.prev)
            expand = consumer_columns_to_channels(config, prev, linears[0].in_features)
            x_amax = input_amax[names[0]]
            w_amax = torch.cat([m.weight.detach().float() for m in linears]).abs().amax(0)
            if expand is not None:  # one scale per prev channel: the max over the columns reading it
                n = prev.weight.shape[0]
                x_amax = torch.zeros(n).scatter_reduce(0, expand, x_amax.float(), "amax")
                w_amax = torch.zeros(n).scatter_reduce(0, expand, w_amax, "amax")
            s = smoothing_scales(x_amax, w_amax, alpha)
            fold_scales(block, group, s, s if expand is None else s[expand])
            done.append(f"{prefix}{group.prev}")
    return done
