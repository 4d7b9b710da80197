"""INT4 grid accuracy (compiler/quant/int4.py) on fresh random weights, checked against what the
grid must satisfy rather than against the formula it is built from: every weight within half a
step of its reconstruction, and on the nearest code; zero points and codes in range; constant and
all-zero groups reconstructed exactly; padded columns exactly zero without moving the last
group's grid."""
from __future__ import annotations

import pytest
import torch

from compiler.formats.int4 import Int4Linear
from compiler.quant.int4 import (QMAX, SYMMETRIC_ZERO, choose_qparams, dequantize, pad_columns, quantize,
                               storage_scale)

GROUPS = (32, 64, 128, 256)


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    """Rows of very different magnitudes, skewed groups, and planted constant / all-zero groups."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-4, 2, n, dtype=torch.float32)[:, None]
    w[1] = w[1].abs()  # all positive: the range is [0, max]
    w[2] = -w[2].abs()  # all negative
    w[3, :32] = 0.37  # constant positive group (for g = 32; part of a group otherwise)
    w[4, :32] = -2.5  # constant negative group
    w[5] = 0.0  # all-zero groups
    w[6, 5] = 1e3  # one outlier in a group
    return w


def expand(per_group: torch.Tensor, g: int) -> torch.Tensor:
    return per_group.float().repeat_interleave(g, dim=1)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("zero_point", [True, False])
@pytest.mark.parametrize("g", GROUPS)
def test_reconstruction_within_half_a_step_on_the_nearest_code(g, zero_point, seed):
    w = weights(12, 2 * 256, seed + g)
    scale, zero = choose_qparams(w, g, zero_point)
    q = quantize(w, scale, zero, g)
    assert q.dtype == torch.uint8 and int(q.max()) <= QMAX
    assert bool((scale > 0).all() and torch.isfinite(scale).all())
    assert torch.equal(scale.to(torch.float16).float(), scale)  # float16 values (storage_scale): vLLM takes them as they are
    if zero_point:
        assert zero.dtype == torch.uint8 and int(zero.max()) <= QMAX
    else:
        assert bool((zero == SYMMETRIC_ZERO).all()) and int(q.min()) >= 1  # symmetric: codes 1..15 (±7 steps)
    back = dequantize(q, scale, zero, g).float()
    step = expand(scale, g)
    err = (back - w).abs()
    slack = 1e-6 * w.abs() + 1e-12  # float32 rounding of w / s and (q - z) * s
    worst = float((err / step).max())
    assert bool((err <= step / 2 + slack).all()), f"worst error {worst:.4f} steps"
    # no other code is closer (round to nearest, not merely within the range)
    zf = expand(zero, g)
    for delta in (-1, 1):
        other = (q.float() + delta).clamp(0, QMAX)
        assert bool((err <= ((other - zf) * step - w).abs() + slack).all())


@pytest.mark.parametrize("zero_point", [True, False])
def test_constant_and_all_zero_groups_are_exact(zero_point):
    g = 32
    w = weights(8, 64, 3)
    scale, zero = choose_qparams(w, g, zero_point)
    back = dequantize(quantize(w, scale, zero, g), scale, zero, g)
    assert torch.equal(back[5], torch.zeros(64))  # all zero: zeros, never NaN from a zero scale
    assert bool(torch.isfinite(back).all())
    for row, value in ((3, 0.37), (4, -2.5)):  # exact but for the scale's float16 rounding (2^-11 relative)
        assert torch.allclose(back[row, :32], torch.full((32,), value), rtol=2.0 ** -11, atol=0)


@pytest.mark.parametrize("zero_point", [True, False])
def test_clipped_grid_saturates_only_beyond_its_range(zero_point):
    g, clip = 64, 0.6
    w = weights(10, 256, 4)
    scale, zero = choose_qparams(w, g, zero_point, clip)
    q = quantize(w, scale, zero, g)
    back = dequantize(q, scale, zero, g).float()
    step, zf = expand(scale, g), expand(zero, g)
    lo, hi = (0 - zf) * step, (QMAX - zf) * step
    inside = (w >= lo - step / 2) & (w <= hi + step / 2)
    assert bool(((back - w).abs()[inside] <= step[inside] / 2 + 1e-6 * w.abs()[inside] + 1e-12).all())
    assert bool((q[w > hi + step / 2] == QMAX).all()) and bool((q[w < lo - step / 2] == 0).all())


@pytest.mark.parametrize("zero_point", [True, False])
@pytest.mark.parametrize("k, g", [(96, 64), (200, 128), (576, 256), (33, 32)])
def test_padded_columns_are_exact_zeros_and_leave_the_grid_alone(k, g, zero_point):
    torch.manual_seed(k + g)
    lin = torch.nn.Linear(k, 24)
    q = Int4Linear.from_float(lin, g, zero_point)
    codes, zero = q.codes()
    kp = q.n_blocks * g
    assert kp > k and codes.shape == (24, kp)
    assert torch.equal(codes[:, k:], zero[:, -1:].expand(-1, kp - k))  # padded codes are the zero point
    full = dequantize(codes, q.scales, zero, g)
    assert torch.equal(full[:, k:], torch.zeros(24, kp - k))  # and dequantize to exactly 0
    # the last group's grid is that of its real columns alone: padding zeros move neither end
    tail = lin.weight.detach()[:, (q.n_blocks - 1) * g:]
    s_tail, z_tail = choose_qparams(pad_columns(tail, g), g, zero_point)
    w_tail = tail.float()
    if zero_point:
        want = ((w_tail.amax(1).clamp(min=0) - w_tail.amin(1).clamp(max=0)) / QMAX)
    else:
        want = w_tail.abs().amax(1) / (SYMMETRIC_ZERO - 1)
    assert torch.equal(q.scales[:, -1], storage_scale(want, torch.float32)) and torch.equal(s_tail[:, 0], q.scales[:, -1])
    assert torch.equal(z_tail[:, 0], zero[:, -1])
    # the layer computes with the real columns only
    x = torch.randn(3, k)
    ref = x @ q.dequantized_weight().t() + lin.bias.detach()
    assert torch.allclose(q(x), ref, atol=1e-5)
