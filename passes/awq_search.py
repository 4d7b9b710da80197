"""AWQ's two searches (scales, clipping) on the statistics of each block's inputs.

Every loss here (the scale search's first cut, and the clip search) is the output error of
the affected linear layers on calibration tokens, computed exactly from the Gram matrix of
their inputs: for inputs X [T, K] and a weight error D = Q(W) - W [N, K],

    ||X D^T||^2 = sum((D @ H) * D)    with H = X^T X  [K, K].

H is accumulated once per block, on a subsample of the captured tokens, by the calibration
collector (``compiler.pipeline.calibration``, ``gram="sampled"``), so each point of
the α grid or the clip grid costs one [N, K] x [K, K] product instead of a forward pass over
every calibration token — this is where the speed over the reference implementations
(which re-run the block's sub-modules on all tokens for each grid point) comes from.
"""
from __future__ import annotations

import torch

from compiler.quant.int4 import QMAX, SYMMETRIC_ZERO, pad_columns, storage_scale


def output_error(delta: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """Mean squared output error per token (summed over outputs) of weight error delta [N, K]."""
    return ((delta @ hessian) * delta).sum()


def fast_fake_quantize(w: torch.Tensor, group_size: int, zero_point: bool, clip_ratio=1.0) -> torch.Tensor:
    """``compiler.quant.int4.fake_quantize`` for float32 ``w`` [N, K] (K a multiple of the group), with
    fewer passes over memory: the searches call it hundreds of times per block. Same result."""
    n, k = w.shape
    x = w.view(n, k // group_size, group_size)
    if isinstance(clip_ratio, torch.Tensor):
        clip_ratio = clip_ratio[..., None]  # [N, n_blocks] -> per group
    if zero_point:
        wmin, wmax = torch.aminmax(x, dim=-1, keepdim=True)
        wmax, wmin = wmax.clamp(min=0) * clip_ratio, wmin.clamp(max=0) * clip_ratio
        scale = storage_scale((wmax - wmin) / QMAX, torch.float32)
        zero = (-wmin / scale).round().clamp(0, QMAX)
    else:
        scale = storage_scale(x.abs().amax(-1, keepdim=True) * clip_ratio / (SYMMETRIC_ZERO - 1), torch.float32)
        zero = torch.full_like(scale, SYMMETRIC_ZERO)
    q = (x / scale).round_().add_(zero).clamp_(0, QMAX)
    return q.sub_(zero).mul_(scale).view(n, k)


def quant_error(w: torch.Tensor, grid, clip_ratio=1.0) -> torch.Tensor:
    """RTN weight error Q(w) - w [N, K] on ``grid`` (``passes/awq_grid.py``); K is zero-padded for quantizing."""
    k = w.shape[1]
    return grid.fake_quantize(grid.pad(w), clip_ratio)[:, :k] - w


def relative_error(w: torch.Tensor, delta: torch.Tensor, hessian: torch.Tensor) -> float:
    """||X D^T|| / ||X W^T||: the layer's relative output error on the calibration tokens."""
    signal = output_error(w, hessian).clamp(min=1e-30)
    return float((output_error(delta, hessian) / signal).sqrt())


def candidate_scales(mean_abs: torch.Tensor, alpha: float, weight_mean: torch.Tensor | None = None) -> torch.Tensor:
    """s = mean|x|^α (or, with ``weight_mean``, AutoAWQ's duo scaling mean|x|^α / mean|ŵ|^(1-α)),
    normalised so that max(s) * min(s) = 1 (llm-awq's convention)."""
    s = mean_abs.pow(alpha)
    if weight_mean is not None:
        s = s / (weight_mean.pow(1 - alpha) + 1e-4)
    s = s.clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def weight_mean(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Mean over rows of |w| relative to its group's max, per input column [K] (AutoAWQ's w_mean)."""
    g = pad_columns(w.abs(), group_size).view(w.shape[0], -1, group_size)
    return (g / (g.amax(-1, keepdim=True) + 1e-6)).view(w.shape[0], -1)[:, : w.shape[1]].mean(0)


def rank_scales(parts: list[tuple[torch.Tensor, torch.Tensor, float]], stats_mean: torch.Tensor, grid,
                alpha_grid: int, expand: torch.Tensor | None = None,
                w_mean: torch.Tensor | None = None) -> list[tuple[float, float, torch.Tensor]]:
    """Every α of the grid for a scaling group's linears, as (error, α, s [C]) sorted best first by
    their output error (the Gram loss). ``parts``: (weights [N, K], H [K, K], share) per distinct
    input, the linears reading it stacked; the error is Σ share · output error (one part of
    share 1 unless an MoE norm feeds experts that see different tokens).

    ``stats_mean`` [C] is mean |x| per *scalable* channel; ``expand`` [K] maps each input column
    to its scalable channel when they differ (GQA: one v channel feeds n_heads / n_kv_heads
    columns of o_proj). α runs over {0, 1/grid, …}; without ``w_mean``, α = 0 is plain RTN.
    """
    parts = [(w.float(), h, share) for w, h, share in parts]
    ranked = []
    for i in range(alpha_grid):
        alpha = i / alpha_grid
        s = candidate_scales(stats_mean, alpha, w_mean)
        s_cols = s if expand is None else s[expand]
        error = 0.0
        for w, h, share in parts:
            # Quantize the scaled weight, then undo the scale: the error as the float model sees it.
            delta = quant_error(w * s_cols, grid) / s_cols
            error += share * float(output_error(delta, h))
        ranked.append((error, alpha, s))
    return sorted(ranked, key=lambda r: r[0])


def block_diagonal(hessian: torch.Tensor, group_size: int) -> torch.Tensor:
    """The [n_blocks, g, g] diagonal blocks of H (zero-padded to a multiple of g)."""
    k = hessian.shape[0]
    pad = (-k) % group_size
    h = torch.nn.functional.pad(hessian, (0, pad, 0, pad))
    n_blocks = h.shape[0] // group_size
    blocks = h.view(n_blocks, group_size, n_blocks, group_size)
    return blocks.diagonal(dim1=0, dim2=2).permute(2, 0, 1)


def search_clip(weight: torch.Tensor, hessian: torch.Tensor, grid, clip_grid: int, max_shrink: float) -> torch.Tensor:
    """Per (output row, block of ``grid``) clip ratio in {1, 1 - max_shrink/clip_grid, …} minimising
    that block's contribution to the output error (cross-block terms ignored, as in llm-awq). -> [N, n_blocks]."""
    group_size = grid.block
    w = grid.pad(weight.float())
    n, kp = w.shape
    blocks = block_diagonal(hessian, group_size)  # [nb, g, g]
    best_err = torch.full((n, kp // group_size), float("inf"))
    best_ratio = torch.ones_like(best_err)
    for i in range(max(1, int(round(max_shrink * clip_grid)))):
        ratio = 1.0 - i / clip_grid
        delta = (grid.fake_quantize(w, ratio) - w).view(n, -1, group_size)
        err = torch.einsum("nbg,bgh,nbh->nb", delta, blocks, delta)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    return best_ratio


def refit_scales(w: torch.Tensor, levels: torch.Tensor, scales: torch.Tensor, hessian: torch.Tensor, store,
                 budget: int = 1 << 24) -> torch.Tensor:
    """Scales re-fit to fixed codes (``scale_refit``; NNCF's scale estimation, in closed form): per row n,
    s_n = argmin ||X (w_n - s_n ⊗ levels_n)ᵀ||² over its n_blocks scales, each taking K / n_blocks
    consecutive columns of ``levels`` = q - z [N, K] (w [N, K] and ``hessian`` [K, K] padded alike).
    ``store`` rounds them as the format keeps them; a row keeps ``scales`` [N, n_blocks] unless the
    re-fit lowers its error, so the layer's output error never rises."""
    n, k = levels.shape
    nb = scales.shape[1]
    h = hessian.double()
    hb = h.view(nb, k // nb, nb, k // nb)
    out = scales.clone()
    step = max(1, budget // (k * nb))  # rows per chunk: the einsum holds [rows, nb, nb, K / nb]
    for start in range(0, n, step):
        rows = slice(start, start + step)
        d, wr, old = levels[rows].double(), w[rows].double(), scales[rows]
        blocks = d.view(-1, nb, k // nb)
        m = torch.einsum("rbk,bkcl,rcl->rbc", blocks, hb, blocks)  # the normal equations' matrix per row
        r = (blocks * (wr @ h).view(-1, nb, k // nb)).sum(-1)
        diag = m.diagonal(dim1=1, dim2=2)
        dead = diag <= 0  # a block of zero levels (or unseen inputs): nothing to fit, it keeps its scale
        r = torch.where(dead, old.double(), r)
        diag += torch.where(dead, 1.0, 1e-12 * diag.mean(-1, keepdim=True))
        fit = store(torch.linalg.solve(m, r))
        better = _row_errors(wr, d, fit, h) < _row_errors(wr, d, old, h)
        out[rows] = torch.where(better[:, None], fit, old)
    return out


def _row_errors(w: torch.Tensor, levels: torch.Tensor, scales: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Each row's output error (Gram form) with weights ``scales`` ⊗ ``levels``; NaN counts as worse."""
    nb = scales.shape[1]
    delta = (levels.view(levels.shape[0], nb, -1) * scales.double()[..., None]).view_as(w) - w
    return ((delta @ h) * delta).sum(1).nan_to_num(float("inf"))
