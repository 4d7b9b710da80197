"""INT8 quantization primitives (W8A8 / W8A16): weights per output channel, activations per token
or per tensor. Kept apart from the ``int8`` weight format (``compiler/formats/int8.py``) and its
kernel (``compiler/kernels/w8a8_cpu.py``), which compute exactly what these define.

Weights are symmetric per output channel, as compressed-tensors' W8A8 preset and msModelSlim's W8A8:

    s_w[n] = max_k |W[n, k]| / 127,   q_w = clamp(round(W / s_w), -127, 127)   (int8, ties to even)

Activations, in the conventions vLLM's ``scaled_int8_quant`` computes them (so that an artifact,
its vLLM export and the engine round a token alike):

    dynamic symmetric   per token:  s = max|x| / 127,  q = round(x / s),  zp = 0
    dynamic asymmetric  per token:  s = (max x - min x) / 255,  zp = round(-128 - min x / s),
                                    q = clamp(round(x / s) + zp, -128, 127)
    static              per tensor: the calibrated s (and zp, asymmetric), q as above

and the output of a layer is, exactly in int32 then in float32,

    y[m, n] = s_a[m] s_w[n] (sum_k q_a[m, k] q_w[n, k] - zp[m] sum_k q_w[n, k]) + b[n].

A token whose scale would be 0 (all zeros; asymmetric: all equal) takes its range with 0 added to it,
so that it still round-trips (an all-zero token: codes and scale 0). A token holding NaN or inf
gives NaN outputs, never a finite guess (dynamic: a NaN scale; static: ``Int8Linear`` and the
kernel set the row's outputs to NaN). An asymmetric zero point of a token far from 0 relative to
its range (|min / s| > 2^31) does not fit int32, as in vLLM's int32 correction term.
"""
from __future__ import annotations

import torch

QMAX = 127
QMIN_ASYMMETRIC = -128
LEVELS_ASYMMETRIC = 255  # codes -128..127


def weight_scale(weight: torch.Tensor) -> torch.Tensor:
    """float32 [N]: each output row's abs-max over 127 (an all-zero row: 1, its codes all 0)."""
    amax = weight.detach().float().abs().amax(dim=1)
    return torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))


def quantize_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] of ``weight`` on the per-row ``scale`` [N], symmetric (-127..127)."""
    return (weight.float() / scale.float()[:, None]).round_().clamp_(-QMAX, QMAX).to(torch.int8)


def dequantize_weight(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float()[:, None]


def symmetric_scales(amax: torch.Tensor) -> torch.Tensor:
    return amax.float() / QMAX


def asymmetric_qparams(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, int32 zero point) mapping [low, high] onto -128..127, with 0 inside the range
    whenever the range is empty (all values equal), so that it still has a step."""
    low, high = low.float(), high.float()
    empty = high == low
    low = torch.where(empty, low.clamp(max=0), low)
    high = torch.where(empty, high.clamp(min=0), high)
    scale = (high - low) / LEVELS_ASYMMETRIC
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero_point = torch.where(scale > 0, torch.round(QMIN_ASYMMETRIC - low / safe), torch.zeros_like(scale))
    return scale, zero_point.to(torch.int32)


def quantize_activations(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None) -> torch.Tensor:
    """int8 codes of x [M, K] on per-row (``scale`` [M, 1]) or per-tensor ([1]) parameters:
    round(x / s) (+ zp, clamped to -128..127), symmetric clamped to -127..127; 0 where s is 0."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x.float() / safe)
    if zero_point is None:
        q = q.clamp_(-QMAX, QMAX)
    else:
        q = (q + zero_point.float()).clamp_(QMIN_ASYMMETRIC, QMAX)
    q = torch.where(scale > 0, q, torch.zeros_like(q) if zero_point is None else zero_point.float().expand_as(q))
    return q.to(torch.int8)


def quantize_per_token(x: torch.Tensor, symmetric: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Dynamic activations: x [M, K] -> (int8 codes [M, K], float32 scales [M, 1], int32 zero points
    [M, 1] or None). A row holding NaN or inf gets a NaN scale."""
    x = x.float()
    finite = torch.isfinite(x).all(dim=1, keepdim=True)
    if symmetric:
        scale, zero_point = symmetric_scales(x.abs().amax(dim=1, keepdim=True)), None
    else:
        scale, zero_point = asymmetric_qparams(x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True))
    q = quantize_activations(torch.where(finite, x, torch.zeros_like(x)), scale, zero_point)
    return q, torch.where(finite, scale, torch.full_like(scale, float("nan"))), zero_point


def int8_gemm(q_a: torch.Tensor, scale_a: torch.Tensor, zero_point: torch.Tensor | None, q_w: torch.Tensor,
              scale_w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [M, N]: s_a s_w (q_a · q_w - zp Σ q_w) + b, the integer part exact in int32
    (``torch._int_mm``: q_a [M, K], q_w [N, K] int8)."""
    if q_a.is_cpu or q_a.shape[0] > 16:
        acc = torch._int_mm(q_a.contiguous(), q_w.t().contiguous())
    else:  # CUDA's _int_mm wants more than 16 rows: the same exact sums in float64 (< 2^53)
        acc = (q_a.double() @ q_w.double().t()).to(torch.int32)
    if zero_point is not None:
        acc = acc - zero_point.reshape(-1, 1) * q_w.sum(dim=1, dtype=torch.int32)
    y = acc.float() * (scale_a.reshape(-1, 1).float() * scale_w.float()[None, :])
    return y if bias is None else y + bias.float()

