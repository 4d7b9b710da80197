"""The C++ CPU kernels' FP8 activation op (``compiler/kernels/cpu_ext.py``) against the torch ops it
replaces (``compiler/quant/fp8.py``): bit for bit, on fresh random inputs. The paged-decode kernel's
tests are in tests/compiler/kernels/test_paged_decode.py."""
from __future__ import annotations

import pytest
import torch

from numerics import relative_error, stable_seed

from compiler.kernels.cpu_ext import pack_fp8_codes
from compiler.kernels.fp8_gemm import dequantize_activations
from compiler.quant.fp8 import quantize, quantize_per_token

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def reference(x, shift, static_scale, dtype):
    """What Fp8Linear's torch path computes: centre, quantize (per token or static), dequantize."""
    x = x if shift is None else x - shift
    if static_scale is None:
        return dequantize_activations(*quantize_per_token(x, dtype))
    return dequantize_activations(quantize(x, static_scale, dtype), static_scale)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("rows, k", [(1, 576), (16, 576), (37, 1536), (3, 7)])
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_fake_quant_rows_equals_the_torch_ops_bit_for_bit(cpu_ops, dtype, rows, k, shift, static):
    g = torch.Generator().manual_seed(rows * k + 2 * shift + static)
    x = torch.randn(rows, k, generator=g) * 3
    x[0, k // 2] = 900.0  # an outlier: saturates E4M3 under a static scale, sets its row's dynamic one
    x[-1, :] = 0.0  # an all-zero row: the scale's lower bound, no NaN
    centre = torch.randn(k, generator=g) if shift else None
    scale = torch.tensor([0.03]) if static else None
    got, scales = cpu_ops.fp8_fake_quant_rows(x, centre, scale, dtype)
    want = reference(x, centre, scale, dtype)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    if not static:
        assert torch.equal(scales, quantize_per_token(x if centre is None else x - centre, dtype)[1])


def test_fake_quant_rows_lets_nan_through_to_its_row_only(cpu_ops):
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    got, scales = cpu_ops.fp8_fake_quant_rows(x, None, None, torch.float8_e4m3fn)
    assert torch.isnan(scales[1]) and torch.isnan(got[1]).all()
    assert torch.equal(got[[0, 2]], reference(x[[0, 2]], None, None, torch.float8_e4m3fn))


def test_fake_quant_rows_refuses_what_it_cannot_take(cpu_ops):
    with pytest.raises(RuntimeError, match="contiguous float32"):
        cpu_ops.fp8_fake_quant_rows(torch.randn(4, 8).t(), None, None, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=r"shift must be float32 \[K\]"):
        cpu_ops.fp8_fake_quant_rows(torch.randn(4, 8), torch.randn(7), None, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="float8_e4m3fn or float8_e5m2"):
        cpu_ops.fp8_fake_quant_rows(torch.randn(4, 8), None, None, torch.bfloat16)


@pytest.mark.parametrize("dtype", FP8)
def test_fake_quant_rows_rounds_every_boundary_as_torchs_cast(cpu_ops, dtype):
    """With a scale of 1 the op is the cast itself: every finite code, every midpoint between two
    neighbours (a tie, rounded to even) and the floats either side of it, both signs, beyond the
    largest value (saturated), NaN, in rows of 16 (the vectorised loop) and a tail (the scalar one)."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = codes[torch.isfinite(codes) & (codes >= 0)].unique().sort().values.double()
    mids = ((values[1:] + values[:-1]) / 2).float()
    x = torch.cat([values.float(), mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9)),
                   torch.tensor([values[-1].item() * 1.01, 1e30, float("inf"), 2 ** -30])])
    x = torch.cat([x, -x, torch.tensor([float("nan")])])
    x = torch.cat([x, torch.zeros(-len(x) % 16 + 16 + 5)])  # whole vectors and a 5-element tail
    rows = x.reshape(1, -1)
    one = torch.tensor([1.0])
    got, _ = cpu_ops.fp8_fake_quant_rows(rows, None, one, dtype)
    want = reference(rows, None, one, dtype)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 20])
def test_fp8_linear_is_the_python_paths_gemm_bit_for_bit(cpu_ops, bias, rows, packed):
    """``fp8_linear`` = the rounded activations times the float32 weight plus the bias, as
    ``float_gemm`` computes them (``dense``: the same addmm, or given the weight packed the same
    packed linear; the same bits), in [B, T, K] shape."""
    import torch.nn.functional as F

    from compiler.kernels.dense_cpu import dense, pack_weight, packing_available

    if packed and not packing_available():
        pytest.fail("neither packed kernel is here: the packed path cannot be checked")
    g = torch.Generator().manual_seed(rows + 2 * bias)
    x, shift = torch.randn(1, rows, 576, generator=g) * 3, torch.randn(576, generator=g)
    w, b = torch.randn(192, 576, generator=g), torch.randn(192, generator=g) if bias else None
    w_packed = pack_weight(w) if packed else None
    got = cpu_ops.fp8_linear(x, shift, None, torch.float8_e4m3fn, w, b, w_packed)
    a, _ = cpu_ops.fp8_fake_quant_rows(x.reshape(rows, 576), shift, None, torch.float8_e4m3fn)
    with torch.inference_mode():
        want = dense(a, w, b, w_packed) if packed else F.linear(a, w, b)
    assert got.shape == (1, rows, 192) and torch.equal(got, want.reshape(1, rows, 192))
    assert relative_error(got, F.linear(a, w, b).reshape(1, rows, 192)) < 1e-6


def codes_case(rows, k, n, weight_dtype, seed, per_tensor=False):
    """x, FP8 weight codes with their scales, shift and bias for a codes-kernel test."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    amax = w.abs().amax() if per_tensor else w.abs().amax(1)
    w_scale = (amax / torch.finfo(weight_dtype).max).reshape(-1)
    codes = (w / w_scale.reshape(-1, 1)).to(weight_dtype)
    return (torch.randn(1, rows, k, generator=g) * 3, codes, w_scale, torch.randn(k, generator=g) * 0.1,
            torch.randn(n, generator=g))


@pytest.mark.parametrize("weight_dtype", FP8)
@pytest.mark.parametrize("activation_dtype", FP8)
@pytest.mark.parametrize("rows, k, n", [(1, 576, 192), (1, 7, 17), (6, 7, 17), (13, 1536, 200), (37, 64, 1)])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_fp8_linear_codes_is_the_dequantize_reference_up_to_rounding(cpu_ops, weight_dtype, activation_dtype, rows, k,
                                                                     n, per_tensor):
    """The codes kernel against the float32 dequantize reference (``fp8_fake_quant_rows`` times
    ``dequantize_weight``): the same FP8 codes, so only float32 rounding apart (relative error
    printed); odd K (a padded pair), N not a multiple of 16 (a masked block), one row (made float32 in
    registers) and 6+ rows (a panel, several tiles)."""
    import torch.nn.functional as F

    from compiler.kernels.fp8_gemm import dequantize_weight

    x, codes, w_scale, shift, bias = codes_case(rows, k, n, weight_dtype, stable_seed(rows, k, n, per_tensor), per_tensor)
    got = cpu_ops.fp8_linear_codes(x, shift, None, activation_dtype, pack_fp8_codes(codes), weight_dtype, w_scale, n, bias)
    a, _ = cpu_ops.fp8_fake_quant_rows(x.reshape(rows, k), shift, None, activation_dtype)
    want = F.linear(a, dequantize_weight(codes, w_scale), bias).reshape(1, rows, n)
    error = relative_error(got, want)
    print(f"codes kernel {rows}x{k}x{n} w={weight_dtype} a={activation_dtype} per_tensor={per_tensor}: {error:.1e}")
    assert got.shape == (1, rows, n) and error < 1e-6


@pytest.mark.parametrize("k", [576, 575])
def test_fp8_linear_codes_rows_do_not_depend_on_the_batch(cpu_ops, k):
    """A row's output is the same bits alone (the one-row path) or among 37 (the panel's tiles, any
    position): a sequence's tokens do not change with what else the engine batches with them. A
    static scale too; an odd K (a padded pair)."""
    x, codes, w_scale, shift, bias = codes_case(37, k, 200, torch.float8_e4m3fn, 11)
    packed = pack_fp8_codes(codes)
    for static in (None, torch.tensor([0.02])):
        batch = cpu_ops.fp8_linear_codes(x, shift, static, torch.float8_e4m3fn, packed, codes.dtype, w_scale, 200, bias)
        for row in (0, 5, 6, 36):
            alone = cpu_ops.fp8_linear_codes(x[:, row : row + 1], shift, static, torch.float8_e4m3fn, packed,
                                             codes.dtype, w_scale, 200, bias)
            assert torch.equal(alone[0, 0], batch[0, row])


def test_fp8_linear_codes_lets_nan_through_to_its_row_only(cpu_ops):
    x, codes, w_scale, _, bias = codes_case(3, 64, 32, torch.float8_e4m3fn, 12)
    x[0, 1, 9] = float("nan")
    got = cpu_ops.fp8_linear_codes(x, None, None, torch.float8_e4m3fn, pack_fp8_codes(codes), codes.dtype, w_scale, 32, bias)
    assert torch.isnan(got[0, 1]).all() and torch.isfinite(got[0, [0, 2]]).all()


@pytest.mark.parametrize("weight_dtype", FP8)
@pytest.mark.parametrize("rows", [1, 7])
def test_a_nan_weight_code_makes_its_channel_nan_and_only_it(cpu_ops, weight_dtype, rows):
    """As the dequantize reference: a NaN code (E4M3's 0x7f/0xff, E5M2's) gives NaN in its output
    channel, for one row and for a panel's rows, never a finite value."""
    x, codes, w_scale, _, _ = codes_case(rows, 64, 40, weight_dtype, 14)
    codes = codes.clone()
    codes[3, 10] = torch.tensor(float("nan")).to(weight_dtype)
    codes[37, 63] = torch.tensor(-float("nan")).to(weight_dtype)
    got = cpu_ops.fp8_linear_codes(x, None, None, torch.float8_e4m3fn, pack_fp8_codes(codes), weight_dtype, w_scale, 40, None)
    nan_channels = got[0].isnan().all(0)
    assert nan_channels[[3, 37]].all() and not nan_channels.sum() > 2 and got[0][:, ~nan_channels].isfinite().all()


def test_fp8_linear_codes_refuses_a_layout_for_another_shape(cpu_ops):
    x, codes, w_scale, _, _ = codes_case(2, 64, 32, torch.float8_e4m3fn, 13)
    with pytest.raises(RuntimeError, match="packed must be pack_fp8_codes"):
        cpu_ops.fp8_linear_codes(x, None, None, torch.float8_e4m3fn, pack_fp8_codes(codes[:, :62]), codes.dtype,
                                 w_scale, 32, None)
    with pytest.raises(RuntimeError, match=r"weight_scale must be float32 \[N\] or \[1\]"):
        cpu_ops.fp8_linear_codes(x, None, None, torch.float8_e4m3fn, pack_fp8_codes(codes), codes.dtype, w_scale[:5],
                                 32, None)
