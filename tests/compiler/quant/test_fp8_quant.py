"""FP8 quantization primitives (``compiler/quant/fp8.py``): saturating casts, scales, per-token quantization."""
from __future__ import annotations

import pytest
import torch
from numerics import relative_error

from compiler.quant.fp8 import (
    FP8_DTYPES,
    quantize,
    quantize_per_token,
    saturating_cast,
    scale_from_amax,
    to_float32,
    weight_scale,
)

DTYPES = list(FP8_DTYPES.values())


@pytest.mark.parametrize("dtype", DTYPES)
def test_saturating_cast_never_overflows_to_nan_or_inf(dtype):
    fmax = torch.finfo(dtype).max
    x = torch.tensor([0.0, 1.0, -1.0, fmax * 1.01, -fmax * 4, 1e30, -1e30, float("inf"), float("-inf")])
    q = saturating_cast(x, dtype).float()
    assert torch.isfinite(q).all()
    assert q[3] == fmax and q[4] == -fmax and q[5] == fmax and q[6] == -fmax and q[7] == fmax and q[8] == -fmax
    assert q[:3].tolist() == [0.0, 1.0, -1.0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5), (16, 170, 3, 64)])  # torch's cast, and the table lookup
def test_to_float32_is_torchs_cast_for_every_code(dtype, shape):
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    codes.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)[: codes.numel()]  # every code, NaNs included
    q = codes.view(dtype)
    for view in (q, q.transpose(0, -1)):  # and a non-contiguous one
        got, want = to_float32(view), view.float()
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got.nan_to_num(123.0), want.nan_to_num(123.0)) and torch.equal(got.isnan(), want.isnan())


def test_scales_map_absmax_to_format_max():
    w = torch.tensor([[1.0, -4.0], [0.5, 0.25], [0.0, 0.0]])
    e4 = torch.float8_e4m3fn
    per_channel = weight_scale(w, e4, "per_channel")
    assert torch.allclose(per_channel[:2], torch.tensor([4.0, 0.5]) / 448)
    assert per_channel[2] > 0  # an all-zero row gets a tiny positive scale, not 0 (no 0/0)
    assert torch.allclose(weight_scale(w, e4, "per_tensor"), torch.tensor([4.0 / 448]))
    assert torch.allclose(scale_from_amax(torch.tensor(57344.0), torch.float8_e5m2), torch.tensor(1.0))
    # the abs-max element lands exactly on the format's largest value
    q = quantize(w, per_channel[:, None], e4).float()
    assert q[0, 1] == -448 and q[1, 0] == 448 and (q[2] == 0).all()


def test_per_token_quantization_round_trip():
    torch.manual_seed(0)
    x = torch.randn(16, 64) * torch.logspace(-3, 3, 16)[:, None]  # rows of very different magnitudes
    q, s = quantize_per_token(x, torch.float8_e4m3fn)
    assert s.shape == (16,) and q.dtype == torch.float8_e4m3fn
    assert relative_error(q.float() * s[:, None], x) < 0.05
