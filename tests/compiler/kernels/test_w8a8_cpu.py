"""qcompile's ``w8a8_linear`` (int8 weights times int8 activations quantized in the call,
``compiler/kernels/w8a8_cpu.py``) against ``compiler/quant/int8.py``'s torch numerics, bit for bit
(``torch.equal``), at every ISA level the CPU runs; relative errors against the float layer are
printed (-s)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import relative_error, stable_seed

from compiler.kernels import w8a8_cpu
from compiler.kernels.w8a8_cpu import pack_w8a8, w8a8_matmul
from compiler.quant.int8 import (
    asymmetric_qparams,
    int8_gemm,
    quantize_activations,
    quantize_per_token,
    quantize_weight,
    symmetric_scales,
    weight_scale,
)

pytestmark = pytest.mark.usefixtures("isa")  # at every ISA level the CPU runs

MODES = ["symmetric", "asymmetric", "static", "static-asymmetric"]
# Against the float layer, int8 weights and int8 activations on Gaussian rows of different ranges:
# measured 0.2e-2 to 2.0e-2 (static, calibrated on the same rows, spans it: one scale for every row).
FLOAT_BOUND = 3e-2


class Layer:
    """A random float layer and its int8 weight (compiler/quant/int8.py), packed for the kernel."""

    def __init__(self, k: int, n: int, bias: bool):
        torch.manual_seed(stable_seed("w8a8", k, n, bias))
        self.weight = torch.randn(n, k) / k ** 0.5
        self.bias = torch.randn(n) if bias else None
        self.scale = weight_scale(self.weight)
        self.codes = quantize_weight(self.weight, self.scale)
        self.pack = pack_w8a8(self.codes)


def static_qparams(x: torch.Tensor, mode: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A per-tensor calibration on x itself (None, None for the dynamic modes)."""
    if mode == "static":
        return symmetric_scales(x.abs().amax().reshape(1)), None
    if mode == "static-asymmetric":
        return asymmetric_qparams(x.amin().reshape(1), x.amax().reshape(1))
    return None, None


def kernel(layer: Layer, x: torch.Tensor, mode: str, qparams=None) -> torch.Tensor:
    scale, zero_point = qparams or static_qparams(x, mode)
    return w8a8_matmul(x, layer.pack, layer.scale, layer.bias, input_scale=scale, input_zero_point=zero_point,
                       symmetric=mode != "asymmetric")


def reference(layer: Layer, x: torch.Tensor, mode: str, qparams=None) -> torch.Tensor:
    """int8.py's torch ops: the activations' codes, then int8_gemm."""
    x = x.float()
    if mode in ("symmetric", "asymmetric"):
        quantized = quantize_per_token(x, symmetric=mode == "symmetric")
    else:
        scale, zero_point = qparams or static_qparams(x, mode)
        quantized = quantize_activations(x, scale, zero_point), scale, zero_point
    return int8_gemm(*quantized, layer.codes, layer.scale, layer.bias)


@pytest.mark.parametrize("k, n, bias", [
    (576, 960, False),   # SmolLM2's fused q/k/v
    (1536, 576, True),   # down_proj, a bias
    (100, 49, True),     # K not a multiple of 4 nor 16, N not a multiple of 16
    (64, 16, False),     # one block
])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 64])
@pytest.mark.parametrize("mode", MODES)
def test_the_kernel_is_int8_gemm_bit_for_bit(k, n, bias, rows, mode):
    layer = Layer(k, n, bias)
    torch.manual_seed(stable_seed(k, n, rows, mode))
    x = torch.randn(rows, k) * torch.rand(rows, 1) * 4 + torch.randn(rows, 1) * 0.5  # rows of different ranges, off centre
    got = kernel(layer, x, mode)
    err = relative_error(got, F.linear(x, layer.weight, layer.bias))
    print(f"w8a8_linear {k}->{n} rows={rows} {mode}: {err:.2e} from the float layer")
    assert got.shape == (rows, n) and got.dtype is torch.float32
    assert torch.equal(got, reference(layer, x, mode)) and err < FLOAT_BOUND


def near_ties(s: torch.Tensor) -> torch.Tensor:
    """float32 values c near (j + 1/2) s whose codes only a true division rounding half to even gets
    right: c / s an exact tie, or c * (1 / s) rounding to the other side. Those first."""
    base = ((torch.arange(-119, 120) + 0.5) * s).float()
    c = torch.cat([base, torch.nextafter(base, 2 * base), torch.nextafter(base, torch.zeros_like(base))])
    q = c / s
    tie, reciprocal_differs = q == q.floor() + 0.5, torch.round(c * (1 / s)) != torch.round(q)
    assert tie.sum() > 50 and reciprocal_differs.sum() > 10  # the test has teeth
    return torch.cat([c[tie | reciprocal_differs], c[~(tie | reciprocal_differs)]])


@pytest.mark.parametrize("mode", MODES)
def test_codes_round_half_to_even_after_a_true_division(mode):
    layer = Layer(579, 49, True)  # 579: some values in the 16- and 8-wide loops' scalar tails
    a = torch.tensor([12.7])  # symmetric: s = 12.7 / 127, asymmetric and static: the range [-a, a]
    s = (a / 127) if mode in ("symmetric", "static") else (2 * a) / 255
    qparams = (s, None) if mode == "static" else (s, asymmetric_qparams(-a, a)[1]) if mode == "static-asymmetric" else None
    values = near_ties(s)
    row = torch.cat([a, -a, values])[:579] if mode != "symmetric" else torch.cat([a, values])[:579]
    x = torch.stack([row, row.flip(0), torch.cat([values[300:], values])[:579]])
    assert torch.equal(kernel(layer, x, mode, qparams), reference(layer, x, mode, qparams))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_activation_makes_its_row_nan_and_only_it(mode, bad):
    layer = Layer(576, 192, True)
    x = torch.randn(3, 576)
    qparams = static_qparams(x, mode)
    clean = kernel(layer, x, mode, qparams)
    x[1, 300] = bad
    got = kernel(layer, x, mode, qparams)
    assert torch.isnan(got[1]).all()
    assert torch.isfinite(got[[0, 2]]).all() and torch.equal(got[[0, 2]], clean[[0, 2]])
    if mode in ("symmetric", "asymmetric"):  # quantize_per_token's NaN scale: the reference agrees
        assert torch.equal(got[[0, 2]], reference(layer, x, mode)[[0, 2]]) and reference(layer, x, mode)[1].isnan().all()


@pytest.mark.parametrize("mode", MODES)
def test_a_zero_row_gives_the_bias(mode):
    layer = Layer(576, 192, True)
    x = torch.randn(3, 576)
    qparams = static_qparams(x, mode)
    x[1] = 0
    got = kernel(layer, x, mode, qparams)
    assert torch.equal(got[1], layer.bias) and torch.equal(got, reference(layer, x, mode, qparams))


@pytest.mark.parametrize("value", [2.5, -0.75, 1e-30])
def test_asymmetric_constant_rows_take_zero_into_their_range(value):
    """All equal: the range [min(v, 0), max(v, 0)], so the row still round-trips (int8.py's empty-range rule)."""
    layer = Layer(100, 49, True)
    x = torch.randn(4, 100)
    x[2] = value
    got = kernel(layer, x, "asymmetric")
    assert torch.equal(got, reference(layer, x, "asymmetric"))
    codes, scale, _ = quantize_per_token(x, symmetric=False)
    assert scale[2] > 0 and codes[2].unique().numel() == 1  # one code, the constant's


def test_asymmetric_rows_away_from_zero_take_zero_points_outside_int8():
    """A row in [1, 2]: zero point round(-128 - 255) = -383, the codes still -128..127."""
    layer = Layer(576, 192, False)
    x = torch.rand(5, 576) + 1
    x[3] = -x[3] * 3
    _, _, zero_point = quantize_per_token(x, symmetric=False)
    assert zero_point.min() < -128 and zero_point.max() > 127
    assert torch.equal(kernel(layer, x, "asymmetric"), reference(layer, x, "asymmetric"))


@pytest.mark.parametrize("mode", ["static", "static-asymmetric"])
def test_static_values_beyond_the_calibrated_range_are_clamped(mode):
    layer = Layer(576, 960, True)
    torch.manual_seed(stable_seed("clamp", mode))
    calibration = torch.randn(8, 576)
    qparams = static_qparams(calibration, mode)
    x = torch.randn(9, 576) * 3  # a third of the values past the calibrated range
    codes = quantize_activations(x, *qparams)
    assert (codes == 127).sum() > 100 and (codes <= -127).sum() > 100
    got = kernel(layer, x, mode, qparams)
    assert torch.equal(got, reference(layer, x, mode, qparams))
    print(f"w8a8_linear static, 3x the calibrated range: {relative_error(got, F.linear(x, layer.weight, layer.bias)):.2e}"
          " from the float layer")


def test_a_static_scale_of_zero_gives_the_bias():
    """quantize_activations' codes where the scale is 0: the zero point's; nothing is added."""
    layer = Layer(64, 16, True)
    x = torch.randn(3, 64)
    qparams = torch.zeros(1), torch.tensor([5], dtype=torch.int32)
    got = kernel(layer, x, "static-asymmetric", qparams)
    assert torch.equal(got, layer.bias.expand(3, -1)) and torch.equal(got, reference(layer, x, "static", qparams))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
def test_half_activations_come_back_in_their_dtype(dtype, mode):
    layer = Layer(576, 960, True)
    x = torch.randn(5, 576).to(dtype)
    got = kernel(layer, x, mode)
    assert got.dtype is dtype and torch.equal(got, reference(layer, x, mode).to(dtype))


def test_leading_dimensions_are_rows():
    layer = Layer(100, 49, True)
    x = torch.randn(2, 3, 100)
    got = kernel(layer, x, "asymmetric")
    assert got.shape == (2, 3, 49) and torch.equal(got.reshape(6, 49), kernel(layer, x.reshape(6, 100), "asymmetric"))


@pytest.mark.parametrize("mode", ["symmetric", "asymmetric"])
def test_a_row_does_not_depend_on_its_batch(mode):
    layer = Layer(576, 960, True)
    x = torch.randn(19, 576)
    batched = kernel(layer, x, mode)
    for i in (0, 7, 8, 18):
        assert torch.equal(kernel(layer, x[i:i + 1], mode)[0], batched[i])


def test_the_pack_is_the_codes_in_blocks():
    codes = torch.randint(-127, 128, (49, 101), dtype=torch.int8)
    pack = pack_w8a8(codes)
    assert pack.codes.shape == (4, 26, 16, 4) and pack.sums.shape == (64,) and pack.out_features == 49
    assert torch.equal(pack.codes[1, 3, 5], codes[16 + 5, 12:16])
    assert torch.equal(pack.codes[3, 25, 0], torch.tensor([codes[48, 100], 0, 0, 0], dtype=torch.int8))
    assert torch.equal(pack.sums[:49], codes.sum(dim=1, dtype=torch.int32)) and not pack.sums[49:].any()


def test_mismatched_operands_are_refused(cpu_ops):
    layer = Layer(576, 192, False)
    p = layer.pack
    with pytest.raises(RuntimeError, match="for x's K"):
        cpu_ops.w8a8_linear(torch.randn(2, 700), p.codes, p.sums, layer.scale, 192, None, None, None, True)
    with pytest.raises(RuntimeError, match="weight_scale"):
        cpu_ops.w8a8_linear(torch.randn(2, 576), p.codes, p.sums, layer.scale[:-1], 192, None, None, None, True)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.w8a8_linear(torch.randn(2, 576).double(), p.codes, p.sums, layer.scale, 192, None, None, None, True)
    with pytest.raises(RuntimeError, match="needs input_scale"):
        cpu_ops.w8a8_linear(torch.randn(2, 576), p.codes, p.sums, layer.scale, 192, None, None,
                            torch.zeros(1, dtype=torch.int32), True)
    with pytest.raises(RuntimeError, match="input_zero_point in -128..127"):
        cpu_ops.w8a8_linear(torch.randn(2, 576), p.codes, p.sums, layer.scale, 192, None, torch.zeros(1),
                            torch.tensor([300], dtype=torch.int32), True)
    with pytest.raises(ValueError, match="int8 codes"):
        pack_w8a8(layer.codes.float())


def test_unavailable_kernels_say_why(monkeypatch):
    assert w8a8_cpu.w8a8_unavailable_reason() is None
    monkeypatch.setattr(w8a8_cpu, "cpu_kernels", lambda: None)
    monkeypatch.setattr(w8a8_cpu, "cpu_kernels_status", lambda: "turned off (QCOMPILE_CPU_KERNELS=0)")
    assert "turned off" in w8a8_cpu.w8a8_unavailable_reason()
