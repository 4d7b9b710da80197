"""The C++ CPU kernels' FP8 activation op (``compiler/kernels/cpu_ext.py``) against the torch ops it
replaces (``compiler/quant/fp8.py``): bit for bit, on fresh random inputs. The paged-decode kernel's
tests are in tests/compiler/kernels/test_paged_decode.py."""
from __future__ import annotations

import pytest
import torch

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
