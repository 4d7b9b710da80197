"""The int8 format (``compiler/formats/int8.py``) and its primitives (``compiler/quant/int8.py``):
``Int8Linear`` against float, its forward against the torch reference bit for bit, the codes and
parameters of each activation mode, its manifest entry. The kernel's own tests: tests/compiler/kernels/test_w8a8_cpu.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from numerics import relative_error, stable_seed

from compiler.errors import ArtifactError
from compiler.formats.int8 import Int8Format, Int8Linear
from compiler.quant.int8 import asymmetric_qparams, int8_gemm, quantize_activations, quantize_per_token

MODES = [("dynamic", True), ("dynamic", False), ("static", True), ("static", False), ("none", True)]
# Against the float layer on Gaussian inputs: per-channel INT8 weights alone ~3e-3, with INT8
# activations per token ~6e-3 (measured 2.4e-3 .. 7.5e-3); a static range is set by the batch's
# extremes, so its steps are coarser (~1e-2).
FLOAT_BOUNDS = {"dynamic": 1.2e-2, "static": 2.5e-2, "none": 6e-3}


def float_layer(k: int, n: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(stable_seed(k, n, bias))
    return nn.Linear(k, n, bias=bias)


def layer(k: int, n: int, scheme: str, symmetric: bool, bias: bool = True, x: torch.Tensor | None = None) -> Int8Linear:
    lin = float_layer(k, n, bias)
    fmt = Int8Format.for_linear(lin, activation_scheme=scheme, activation_symmetric=symmetric)
    qparams = None
    if scheme == "static":
        low, high = float(x.min().clamp(max=0)), float(x.max().clamp(min=0))
        if symmetric:
            qparams = (max(-low, high) / 127, None)
        else:
            scale, zp = asymmetric_qparams(torch.tensor(low), torch.tensor(high))
            qparams = (float(scale), int(zp))
    return Int8Linear.from_linear(lin, fmt, input_qparams=qparams)


@pytest.mark.parametrize("scheme, symmetric", MODES)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_int8_linear_is_close_to_float_and_equal_to_its_reference(scheme, symmetric, rows):
    x = torch.randn(rows, 96) + 0.5 * torch.randn(96)  # channels of different means: asymmetric ranges
    q = layer(96, 40, scheme, symmetric, x=x)
    got = q(x)
    err = relative_error(got, float_layer(96, 40)(x))
    print(f"int8 {scheme} {'symmetric' if symmetric else 'asymmetric'} rows={rows}: {err:.2e} from float")
    assert got.shape == (rows, 40) and got.dtype == x.dtype and err < FLOAT_BOUNDS[scheme]
    if scheme != "none":
        assert torch.equal(got, q.reference_forward(x))


def test_weight_codes_are_symmetric_per_channel_round_to_nearest():
    w = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [-3.0, 1.5, 1.49, 0.01]])
    lin = nn.Linear(4, 3, bias=False)
    lin.weight.data = w
    q = Int8Linear.from_linear(lin, Int8Format(in_features=4, out_features=3))
    assert q.weight.dtype == torch.int8
    assert q.weight[0].tolist() == [127, -64, 32, 0]  # 63.5 rounds half to even: 64
    assert q.weight[1].tolist() == [0, 0, 0, 0] and float(q.weight_scale[1]) == 1.0  # an all-zero row
    assert q.weight[2].tolist() == [-127, 64, 63, 0]
    assert torch.allclose(q.weight_scale, torch.tensor([1 / 127, 1.0, 3 / 127]))


def test_dynamic_activation_parameters_follow_vllms_conventions():
    x = torch.tensor([[-1.0, 0.0, 2.0, 3.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])
    q, s, zp = quantize_per_token(x, symmetric=True)
    assert torch.allclose(s[:, 0], torch.tensor([3 / 127, 0.5 / 127, 0.0]))
    assert q[0].tolist() == [-42, 0, 85, 127] and q[2].tolist() == [0, 0, 0, 0] and zp is None
    q, s, zp = quantize_per_token(x, symmetric=False)
    # row 0: s = 4/255, zp = round(-128 + 1/s) = round(-64.25) = -64; row 1: an empty range, widened to [0, 0.5]
    assert torch.allclose(s[:, 0], torch.tensor([4 / 255, 0.5 / 255, 0.0]))
    assert zp[:, 0].tolist() == [-64, -128, 0]
    # 2 / fl32(4/255) is just below 127.5: 127 - 64
    assert q[0].tolist() == [-128, -64, 63, 127] and q[1].tolist() == [127] * 4 and q[2].tolist() == [0] * 4
    ones = torch.ones(4, dtype=torch.int8)[None]
    y = int8_gemm(q, s, zp, ones, torch.ones(1))  # each row's sum back, within a step per element
    assert torch.allclose(y[:, 0], x.sum(1), atol=4 * 4 / 255)


def test_static_codes_clamp_beyond_the_calibrated_range():
    scale, zp = asymmetric_qparams(torch.tensor(-2.0), torch.tensor(127 / 64))  # steps of 1/64 exactly, zp 0
    assert float(scale) == 1 / 64 and int(zp) == 0
    q = quantize_activations(torch.tensor([[-5.0, -2.0, 0.0, 1.0, 5.0]]), scale, zp)
    assert q.tolist() == [[-128, -128, 0, 64, 127]]
    q = quantize_activations(torch.tensor([[-5.0, 5.0]]), torch.tensor([1 / 127]), None)
    assert q.tolist() == [[-127, 127]]


@pytest.mark.parametrize("scheme, symmetric", [("dynamic", True), ("dynamic", False), ("static", False)])
def test_a_row_with_nan_or_inf_gives_nan_in_that_row_only(scheme, symmetric):
    x = torch.randn(3, 64)
    q = layer(64, 16, scheme, symmetric, x=x)
    x[1, 5], x[2, 9] = float("nan"), float("inf")
    for y in (q(x), q.reference_forward(x)):
        assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all() and torch.isnan(y[2]).all()


def test_bfloat16_input_gives_bfloat16_output_of_the_same_codes():
    q = layer(64, 32, "dynamic", True)
    x = torch.randn(4, 64).bfloat16()
    assert q(x).dtype == torch.bfloat16
    assert torch.equal(q(x), q.reference_forward(x))


def test_manifest_entry_round_trips_and_refuses_malformed_ones():
    fmt = Int8Format(in_features=64, out_features=32, activation_scheme="static", activation_symmetric=False)
    assert fmt.to_dict() == {"format": "int8", "in_features": 64, "out_features": 32, "activation_scheme": "static",
                             "activation_symmetric": False}
    assert Int8Format.from_dict(fmt.to_dict()) == fmt
    for bad, says in [({**fmt.to_dict(), "group_size": 8}, "unknown keys"), ({"format": "int8"}, "lacks"),
                      ({**fmt.to_dict(), "activation_scheme": "sometimes"}, "invalid")]:
        with pytest.raises(ArtifactError, match=says):
            Int8Format.from_dict(bad)
    with pytest.raises(ValueError, match="needs INT8 activations"):
        Int8Format(in_features=4, out_features=4, activation_scheme="none", activation_symmetric=False)


def test_empty_module_has_the_buffers_of_its_scheme():
    m = Int8Linear.empty(Int8Format(in_features=8, out_features=4, activation_scheme="static",
                                    activation_symmetric=False).to_dict(), 8, 4, True, torch.bfloat16)
    assert {n: (t.dtype, tuple(t.shape)) for n, t in m.named_buffers()} == {
        "weight": (torch.int8, (4, 8)), "weight_scale": (torch.float32, (4,)), "input_scale": (torch.float32, (1,)),
        "input_zero_point": (torch.int32, (1,)), "bias": (torch.bfloat16, (4,))}
    with pytest.raises(ArtifactError, match="8 -> 4"):
        Int8Linear.empty(Int8Format(in_features=8, out_features=4).to_dict(), 8, 5, False, torch.float32)
