"""GPTQ's error-compensating rounding (passes/gptq.py) against round-to-nearest."""
from __future__ import annotations

import pytest
import torch

from compiler.formats.int4 import Int4Linear
from compiler.quant.fp8 import dequantize, quantize, weight_scale
from passes.gptq import gptq_int4, gptq_round


def correlated_inputs(t=2048, k=256, rank=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, rank, generator=g) @ torch.randn(rank, k, generator=g) + 0.1 * torch.randn(t, k, generator=g)


def fp8_rounder(w):
    scale = weight_scale(w, torch.float8_e4m3fn, "per_channel")[:, None]
    return lambda cols, _: dequantize(quantize(cols, scale, torch.float8_e4m3fn), scale)


@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_lowers_output_error_and_stays_on_the_grid(act_order):
    x = correlated_inputs(seed=1)
    w = torch.randn(64, x.shape[1], generator=torch.Generator().manual_seed(2)) * 0.02
    rnd = fp8_rounder(w)
    q = gptq_round(w, x.T @ x / len(x), rnd, block_size=32, act_order=act_order)
    rel = lambda q: float((x @ (q - w).T).norm() / (x @ w.T).norm())  # noqa: E731
    print(f"act_order={act_order}: relative output error nearest {rel(rnd(w, None)):.4f}, gptq {rel(q):.4f}")
    assert torch.isfinite(q).all()
    assert torch.equal(rnd(q, None), q)  # every value is a code of the format at the row's scale
    assert rel(q) < 0.5 * rel(rnd(w, None))


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest():
    """H diagonal: no column can absorb another's error, so GPTQ is exactly RTN."""
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    rnd = fp8_rounder(w)
    assert torch.equal(gptq_round(w, torch.diag(torch.rand(32) + 0.5), rnd), rnd(w, None))


def test_exact_columns_stay_float_and_absorb_the_others_error():
    """Columns a format keeps in float (fp8's outlier channels) are not rounded; being last, they take
    compensation from every other column, so the output error falls below rounding the rest alone."""
    x = correlated_inputs(seed=8)
    w = torch.randn(64, x.shape[1], generator=torch.Generator().manual_seed(9)) * 0.02
    exact = torch.tensor([3, 100, 200])
    rest = torch.ones(x.shape[1], dtype=torch.bool)
    rest[exact] = False
    rnd = fp8_rounder(w)
    h = x.T @ x / len(x)
    q = gptq_round(w, h, rnd, block_size=32, exact=exact)
    rel = lambda q: float((x @ (q - w).T).norm() / (x @ w.T).norm())  # noqa: E731
    untouched = gptq_round(w, h, rnd, block_size=32).clone()
    untouched[:, exact] = w[:, exact]  # the same rounding, with float columns that compensate nothing
    print(f"relative output error: exact columns compensating {rel(q):.4f}, not compensating {rel(untouched):.4f}")
    assert torch.equal(rnd(q[:, rest], None), q[:, rest])  # the others on the grid
    assert not torch.equal(q[:, exact], w[:, exact]) and not torch.equal(rnd(q[:, exact], None), q[:, exact])
    assert rel(q) < 0.9 * rel(untouched)


def test_gptq_handles_channels_never_active():
    x = correlated_inputs(k=64, seed=4)
    x[:, 5] = 0
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    q = gptq_round(w, x.T @ x, fp8_rounder(w))
    assert torch.isfinite(q).all() and q[:, 5].eq(0).all()  # a dead input's weight does not matter


@pytest.mark.parametrize("k, g, zero_point", [(256, 64, True), (200, 64, True), (256, 32, False)])
def test_gptq_int4_keeps_the_rtn_grid_and_lowers_output_error(k, g, zero_point):
    """Same scales and zero points as Int4Linear.from_float (AWQ's clip included), better codes;
    K not a multiple of g (200) is padded like every Int4Linear."""
    x = correlated_inputs(k=k, seed=6)
    linear = torch.nn.Linear(k, 48, bias=True).requires_grad_(False)
    linear.weight.copy_(torch.randn(48, k, generator=torch.Generator().manual_seed(7)) * 0.02)
    clip = torch.full((48, -(-k // g)), 0.9)
    rtn = Int4Linear.from_float(linear, g, zero_point, clip)
    q = gptq_int4(linear, x.T @ x / len(x), g, zero_point, clip)
    assert torch.equal(q.scales, rtn.scales) and torch.equal(q.codes()[1], rtn.codes()[1])
    assert torch.equal(q.bias, rtn.bias)
    rel = lambda m: float((x @ (m.dequantized_weight() - linear.weight).T).norm() / (x @ linear.weight.T).norm())  # noqa: E731
    print(f"k={k} g={g} zero_point={zero_point}: relative output error nearest {rel(rtn):.4f}, gptq {rel(q):.4f}")
    assert rel(q) < 0.6 * rel(rtn)
    y = torch.randn(3, k)
    torch.testing.assert_close(q.reference_forward(y), y @ q.dequantized_weight().T + q.bias)  # packed codes reproduce the rounded weight
