"""GPTQ's error-compensating rounding (Frantar et al., ICLR 2023), for any element-wise format.

Rounding column j of a weight W [N, K] to the target grid leaves an error; GPTQ spreads it over
the columns not yet rounded, weighted by the inverse Hessian of the layer's output error
H = XᵀX / T (X: calibration inputs), so that ``||X (Q - W)ᵀ||²`` ends up far below
round-to-nearest's; the passes take H from the calibration collector
(``compiler/pipeline/calibration.py``, ``InputRequest(gram=...)``). The quantizer's parameters
(row or group scales, zero points) are fixed beforehand from the weight, as with GPTQ's static
groups, so the loop serves any such format: the ``fp8`` pass uses ``gptq_round`` directly, the
``awq`` pass ``gptq_int4`` (per-group INT4 scales and zero points from AWQ's clipped range).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from compiler.formats.int4 import Int4Linear
from compiler.quant.int4 import QMAX, choose_qparams, pad_columns, quantize

RoundColumns = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def gptq_round(weight: torch.Tensor, hessian: torch.Tensor, round_columns: RoundColumns,
               block_size: int = 128, damp: float = 0.01, act_order: bool = True,
               exact: torch.Tensor | None = None) -> torch.Tensor:
    """Weight [N, K] rounded by ``round_columns(values [N, b], columns [b]) -> [N, b]`` (values
    on the grid; ``columns`` are their indices in ``weight``, for formats with per-group scales),
    with GPTQ's error compensation. ``damp`` (fraction of H's mean diagonal) keeps the Cholesky
    factorisation stable; ``act_order`` rounds the columns with the largest inputs first.
    ``exact`` (indices) are columns the format keeps in float: they come last and are not
    rounded, so they take the compensation of every other column's error (as in QUIK)."""
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    k = w.shape[1]
    dead = h.diagonal() == 0  # channels never active in calibration: nothing to compensate with
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    order = torch.argsort(h.diagonal(), descending=True) if act_order else torch.arange(k)
    is_exact = torch.zeros(k, dtype=torch.bool, device=h.device)
    if exact is not None:
        is_exact[exact] = True
        order = torch.cat([order[~is_exact[order]], order[is_exact[order]]])
    exact_at = is_exact[order].tolist()  # by position in the rounding order
    w, h = w[:, order], h[order][:, order]
    h.diagonal().add_(damp * h.diagonal().mean())
    # Upper Cholesky factor of H⁻¹: row i holds the update of columns i.. after rounding column i.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.empty_like(w)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of small ops: thread hand-offs cost more than they save
    try:
        _round_blocks(w, hinv, q, lambda values, i: values if exact_at[i] else round_columns(values, order[i : i + 1]),
                      block_size)
    finally:
        torch.set_num_threads(threads)
    return q[:, torch.argsort(order)].to(weight.dtype)


def _round_blocks(w, hinv, q, round_columns, block_size):
    """GPTQ's loop: column by column inside a block, one matmul per block for the rest (lazy batch)."""
    k = w.shape[1]
    for start in range(0, k, block_size):
        end = min(start + block_size, k)
        block, hb = w[:, start:end].clone(), hinv[start:end, start:end]
        errors = torch.empty_like(block)
        for i in range(end - start):
            col = block[:, i : i + 1]
            rounded = round_columns(col, start + i)
            q[:, start + i] = rounded[:, 0]
            err = (col - rounded) / hb[i, i]
            block[:, i:] -= err @ hb[i : i + 1, i:]
            errors[:, i : i + 1] = err
        w[:, end:] -= errors @ hinv[start:end, end:]  # the columns still to round


def gptq_int4(linear: torch.nn.Linear, hessian: torch.Tensor, group_size: int, zero_point: bool,
              clip_ratio: torch.Tensor | float = 1.0, damp: float = 0.01) -> Int4Linear:
    """``Int4Linear.from_float`` with GPTQ's rounding: same scales and zero points (from the clipped
    range of each group), codes chosen column by column with error compensation over ``hessian`` [K, K]."""
    w = pad_columns(linear.weight.detach().float(), group_size)
    pad = w.shape[1] - hessian.shape[0]
    h = F.pad(hessian, (0, pad, 0, pad))  # padded columns never see an input: GPTQ treats them as dead
    scale, zero = choose_qparams(w, group_size, zero_point, clip_ratio, dtype=linear.weight.dtype)
    scale_f, zero_f = scale.float(), zero.float()

    def round_columns(values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        s, z = scale_f[:, columns // group_size], zero_f[:, columns // group_size]
        return ((values / s).round() + z).clamp(0, QMAX).sub(z).mul(s)

    rounded = gptq_round(w, h, round_columns, damp=damp)
    codes = quantize(rounded, scale, zero, group_size)  # already on the grid: this only reads the codes off
    return Int4Linear.from_codes(codes, scale, zero, linear.in_features, group_size, zero_point, linear.bias)
