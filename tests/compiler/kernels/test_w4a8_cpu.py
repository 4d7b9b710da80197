"""qcompile's ``w4a8_linear`` (INT4 weights times int8 activations, ``compiler/kernels/w4a8_cpu.py``)
against ``w4a8_reference`` (the same formula in torch, float64) and the format's W4A16 reference,
on fresh random inputs; relative errors are printed (-s)."""
from __future__ import annotations

import pytest
import torch
from call_recorder import record_calls
from numerics import relative_error, stable_seed

import compiler.formats.int4 as int4_format
from compiler.formats.int4 import Int4Linear
from compiler.kernels import w4a8_cpu
from compiler.kernels.int4_cpu import reference_only
from compiler.kernels.w4a8_cpu import pack_w4a8, quantize_activations, w4a8_matmul, w4a8_reference

pytestmark = pytest.mark.usefixtures("isa")  # at every ISA level the CPU runs

# The integer sums are exact; the float32 scaling of each group's sum is rounded in another order
# than the float64 reference: measured ~1e-7 to 3e-7.
TOLERANCE = 2e-6
# Against the format's W4A16 numerics the activations' int8 rounding adds ~6e-3 on Gaussian rows.
W4A16_BOUND = 1.5e-2


def random_layer(k: int, n: int, group: int, bias: bool, zero_point: bool = True) -> Int4Linear:
    torch.manual_seed(stable_seed(k, n, group, bias, zero_point))
    return Int4Linear.from_float(torch.nn.Linear(k, n, bias=bias), group, zero_point)


def kernel(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    q, zero = layer.codes()
    return w4a8_matmul(x, pack_w4a8(q, layer.scales, zero, layer.group_size), layer.bias)


def reference(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    return w4a8_reference(x, layer.dequantized_weight(), layer.group_size, layer.n_blocks * layer.group_size, layer.bias)


@pytest.mark.parametrize("k, n, group, bias, zero_point", [
    (576, 960, 64, False, True),     # SmolLM2's fused q/k/v
    (1536, 576, 128, True, True),    # down_proj, a bias
    (576, 192, 128, False, True),    # K padded: 576 of 640
    (100, 49, 32, True, False),      # K padded, N not a multiple of 16, symmetric
    (64, 16, 64, False, True),       # one group, one block
])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17])
def test_the_kernel_matches_its_reference(k, n, group, bias, zero_point, rows):
    layer = random_layer(k, n, group, bias, zero_point)
    x = torch.randn(rows, k) * torch.rand(rows, 1) * 4  # rows of different ranges
    got = kernel(layer, x)
    err = relative_error(got, reference(layer, x))
    err_w4a16 = relative_error(got, layer.reference_forward(x))
    print(f"w4a8_linear {k}->{n} g{group} rows={rows}: {err:.2e} from its reference, {err_w4a16:.2e} from W4A16")
    assert got.shape == (rows, n) and err < TOLERANCE and err_w4a16 < W4A16_BOUND


def test_the_activation_codes_are_torchs_rounding():
    """The reference's codes: round half to even of a * (127 / amax), within [-127, 127], zeros past K."""
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0, 127.0, 1.5, -2.5, 3.0]]) / 127 * 2
    q, s = quantize_activations(x, 8, 16)
    assert q.shape == (1, 2, 8) and torch.equal(q[0, 1], torch.zeros(8))
    assert q.abs().max() == 127 and torch.equal(q[0, 0], torch.round(x[0] * (127 / x.abs().max())))
    assert s[0, 1] == 0  # an all-zero group: scale 0, nothing added


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_activations_come_back_in_their_dtype(dtype):
    layer = random_layer(576, 960, 64, True)
    x = torch.randn(5, 576).to(dtype)
    got = kernel(layer, x)
    err = relative_error(got, reference(layer, x.float()))
    print(f"w4a8_linear, {dtype} activations: {err:.2e} from its reference (the output rounded to {dtype})")
    assert got.dtype is dtype and err < 1e-2


def test_a_row_does_not_depend_on_its_batch():
    """Each row is quantized on its own and summed in one order: bit for bit alone or batched."""
    layer = random_layer(576, 960, 64, True)
    x = torch.randn(19, 576)
    batched = kernel(layer, x)
    for i in (0, 7, 8, 18):
        assert torch.equal(kernel(layer, x[i:i + 1])[0], batched[i])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_activation_makes_its_row_nan_and_only_it(bad):
    layer = random_layer(576, 192, 64, False)
    x = torch.randn(3, 576)
    clean = kernel(layer, x)
    x[1, 300] = bad
    got = kernel(layer, x)
    assert torch.isnan(got[1]).all()
    assert torch.equal(got[0], clean[0]) and torch.equal(got[2], clean[2])


def test_a_zero_row_gives_the_bias():
    layer = random_layer(576, 192, 64, True)
    assert torch.equal(kernel(layer, torch.zeros(2, 576)), layer.bias.expand(2, -1))


def test_mismatched_operands_are_refused(cpu_ops):
    layer = random_layer(576, 192, 64, False)
    q, zero = layer.codes()
    pack = pack_w4a8(q, layer.scales, zero, layer.group_size)
    ops = cpu_ops
    with pytest.raises(RuntimeError, match="covering x's K"):
        ops.w4a8_linear(torch.randn(2, 700), pack.codes, pack.scales, pack.zero_scales, 64, 192, None)
    with pytest.raises(RuntimeError, match="group_size"):
        ops.w4a8_linear(torch.randn(2, 576), pack.codes, pack.scales, pack.zero_scales, 12, 192, None)
    with pytest.raises(RuntimeError, match="n_groups"):
        ops.w4a8_linear(torch.randn(2, 576), pack.codes, pack.scales[:, :-1].contiguous(), pack.zero_scales, 64, 192, None)
    with pytest.raises(RuntimeError, match="float32"):
        ops.w4a8_linear(torch.randn(2, 576).double(), pack.codes, pack.scales, pack.zero_scales, 64, 192, None)


# -- Int4Linear on W4A8 ----------------------------------------------------------------------------

def record_kernel_calls(monkeypatch) -> list:
    """The calls Int4Linear.forward makes to the W4A8 kernel from now on."""
    return record_calls(monkeypatch, w4a8_cpu, "w4a8_matmul")


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_a_layer_on_w4a8_runs_the_kernel_at_every_row_count(rows, monkeypatch):
    layer = random_layer(576, 960, 64, True)
    assert layer.use_w4a8() is None and layer.kernel == w4a8_cpu.KERNEL and layer.kernel_reason is None
    calls = record_kernel_calls(monkeypatch)
    x = torch.randn(rows, 576)
    with torch.inference_mode():
        got = layer(x)
    assert calls and relative_error(got, reference(layer, x)) < TOLERANCE


def test_w4a8_is_off_by_default_and_can_be_turned_off(monkeypatch):
    layer = random_layer(576, 192, 64, False)
    calls = record_kernel_calls(monkeypatch)
    x = torch.randn(4, 576)
    with torch.inference_mode():
        w4a16 = layer(x)
        layer.use_w4a8()
        layer(x)
        layer.use_w4a8(False)
        again = layer(x)
    assert len(calls) == 1 and torch.equal(again, w4a16) and layer.kernel != w4a8_cpu.KERNEL


def test_reference_only_and_autograd_keep_the_format_numerics(monkeypatch):
    layer = random_layer(576, 192, 64, True)
    layer.use_w4a8()
    calls = record_kernel_calls(monkeypatch)
    x = torch.randn(4, 576)
    with reference_only(), torch.inference_mode():
        assert torch.equal(layer(x), layer.reference_forward(x))
    xg = x.clone().requires_grad_()
    layer(xg).sum().backward()  # the kernel has no backward: W4A16 runs
    assert not calls and xg.grad is not None


def test_the_kept_pack_follows_the_buffers():
    layer = random_layer(576, 192, 64, False)
    layer.use_w4a8()
    x = torch.randn(3, 576)
    with torch.no_grad():
        before = layer(x)
        layer.scales.mul_(2)  # in place: the next call repacks
        after = layer(x)
    assert relative_error(after, 2 * before) < TOLERANCE and relative_error(after, reference(layer, x)) < TOLERANCE


def test_a_layer_the_kernel_cannot_take_says_why_and_stays_w4a16(monkeypatch):
    layer = random_layer(576, 192, 64, False)
    monkeypatch.setattr(int4_format.w4a8_cpu, "layer_unsupported_reason", lambda g: f"group size {g}: no")
    assert layer.use_w4a8() == "group size 64: no"
    assert layer.kernel != w4a8_cpu.KERNEL and not layer._w4a8


def test_unavailable_kernels_say_why(monkeypatch):
    monkeypatch.setenv(w4a8_cpu.ENV_SWITCH, "0")
    assert "turned off" in w4a8_cpu.w4a8_unavailable_reason()
    assert "turned off" in random_layer(64, 16, 32, False).use_w4a8()
    assert w4a8_cpu.layer_unsupported_reason(12) and w4a8_cpu.layer_unsupported_reason(64) is None
