"""INT4 quantization primitives: choose a per-group grid, quantize, dequantize (unpacked tensors).

Kept apart from packing and from the ``Int4Linear`` module (``compiler/formats/int4.py``), as in
torchao, so passes (AWQ, GPTQ, QAT) use them on plain tensors:

    K = in_features (a multiple of the group size g here; callers pad), N = out_features
    codes  uint8 [N, K] in [0, 15];  scale [N, K / g] (the weight's dtype);  zero uint8 [N, K / g]
    w[n, k] = (q[n, k] - z[n, k // g]) * s[n, k // g]

Symmetric quantization fixes the zero point at 8 (MatMulNBits' default) and uses codes 1..15.
Scales are never finer than float16 (``storage_scale``): a float32 model's INT4 layers then carry
over exactly to the engines whose INT4 kernels run in half precision (vLLM's), as AutoAWQ's and
GPTQ's float16 scales do.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

QMAX = 15
SYMMETRIC_ZERO = 8
GROUP_SIZES = (32, 64, 128, 256)
# float16's smallest subnormal and its largest value: a group of zeros keeps a scale it can divide by
SCALE_MIN, SCALE_MAX = 2.0 ** -24, float(torch.finfo(torch.float16).max)


def padded_width(in_features: int, group_size: int) -> int:
    return math.ceil(in_features / group_size) * group_size


def pad_columns(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Zero-pad the last dim of ``w`` to a multiple of ``group_size``."""
    pad = padded_width(w.shape[-1], group_size) - w.shape[-1]
    return F.pad(w, (0, pad)) if pad else w


def storage_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` as an artifact of model dtype ``dtype`` stores it: in that dtype, with float16's
    precision and range at most (a float32 model's scales are float16 values held in float32)."""
    scale = scale.float().clamp(SCALE_MIN, SCALE_MAX)
    if dtype == torch.float32:
        scale = scale.to(torch.float16)
    return scale.to(dtype)


def choose_qparams(w: torch.Tensor, group_size: int, zero_point: bool = True,
                   clip_ratio: torch.Tensor | float = 1.0,
                   dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group scale [N, n_blocks] (in ``dtype``, default w's; ``storage_scale``) and integer zero
    point [N, n_blocks] (uint8), chosen for the stored scale.

    ``w`` [N, K] with K a multiple of ``group_size``; ``clip_ratio`` (scalar or [N, n_blocks])
    shrinks the range before choosing the grid (AWQ's clipping search).
    """
    N, K = w.shape
    dtype = w.dtype if dtype is None else dtype
    groups = w.float().view(N, K // group_size, group_size)
    if zero_point:
        wmax = groups.amax(-1).clamp(min=0) * clip_ratio
        wmin = groups.amin(-1).clamp(max=0) * clip_ratio
        scale = storage_scale((wmax - wmin) / QMAX, dtype)
        zero = (-wmin / scale.float()).round().clamp(0, QMAX)
    else:
        absmax = groups.abs().amax(-1) * clip_ratio
        scale = storage_scale(absmax / (SYMMETRIC_ZERO - 1), dtype)
        zero = torch.full_like(scale, SYMMETRIC_ZERO, dtype=torch.float32)
    return scale, zero.to(torch.uint8)


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """Codes uint8 [N, K] in [0, 15]."""
    N, K = w.shape
    groups = w.float().view(N, K // group_size, group_size)
    q = (groups / scale.float()[..., None]).round() + zero.float()[..., None]
    return q.clamp(0, QMAX).to(torch.uint8).view(N, K)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """Float weights [N, K] in scale's dtype."""
    N, K = q.shape
    groups = q.view(N, K // group_size, group_size).float() - zero.float()[..., None]
    return (groups * scale.float()[..., None]).view(N, K).to(scale.dtype)


def fake_quantize(w: torch.Tensor, group_size: int, zero_point: bool = True, clip_ratio=1.0) -> torch.Tensor:
    """Quantize-dequantize round trip (RTN) of ``w`` [N, K], K a multiple of ``group_size``."""
    scale, zero = choose_qparams(w, group_size, zero_point, clip_ratio)
    return dequantize(quantize(w, scale, zero, group_size), scale, zero, group_size)
