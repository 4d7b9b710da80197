"""qcompile's ``int4_dense_linear`` (an INT4 layer's many-token forward on float32 activations,
``compiler/kernels/int4_cpu.py``) against the dequantize reference, on fresh random inputs;
relative errors are printed (-s)."""
from __future__ import annotations

import pytest
import torch
from call_recorder import record_calls
from numerics import relative_error

import compiler.formats.int4 as int4_format
from compiler.formats.int4 import Int4Linear, unpack_zeros
from compiler.kernels import int4_cpu
from compiler.kernels.int4_cpu import REFERENCE_MIN_TOKENS, int4_dense_matmul

pytestmark = pytest.mark.usefixtures("isa")  # at every ISA level the CPU runs

# the reference's float32 weights, summed in another order: measured ~1e-7 to 7e-7
TOLERANCE = 2e-6


def random_layer(k: int, n: int, group: int, bias: bool, seed: int) -> Int4Linear:
    torch.manual_seed(seed)
    return Int4Linear.from_float(torch.nn.Linear(k, n, bias=bias), group)


def record_kernel_calls(monkeypatch) -> list:
    """The calls Int4Linear.forward makes to the kernel from now on."""
    return record_calls(monkeypatch, int4_format, "int4_dense_matmul")


def dense_call(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    return int4_dense_matmul(x, layer.qweight, layer.scales, unpack_zeros(layer.qzeros, layer.n_blocks),
                             layer.group_size, layer.bias)


@pytest.mark.parametrize("k, n, group, bias", [(576, 960, 64, False), (1536, 576, 128, True), (200, 49, 32, True),
                                               (576, 192, 128, False)])
def test_many_float32_tokens_match_the_reference(k, n, group, bias, monkeypatch):
    """A prefill's tokens (padded K, a bias, N not a multiple of 16 included) through the kernel,
    which the layer's forward takes outside autograd; the same call runs the reference when INT4's
    kernels are turned off."""
    layer = random_layer(k, n, group, bias, seed=k + n)
    x = torch.randn(1, REFERENCE_MIN_TOKENS + 3, k)
    calls = record_kernel_calls(monkeypatch)
    with torch.inference_mode():
        got, want = layer(x), layer.reference_forward(x)
    err = relative_error(got, want)
    print(f"int4_dense_linear {k}->{n} g{group} bias={bias}: relative error {err:.2e}")
    assert calls and got.shape == want.shape and err < TOLERANCE
    monkeypatch.setenv(int4_cpu.ENV_SWITCH, "0")
    with torch.inference_mode():
        assert torch.equal(layer(x), want)


def test_a_row_gets_the_same_bits_in_any_batch_and_nan_stays_in_its_row():
    layer = random_layer(576, 200, 64, True, seed=1)
    x = torch.randn(37, 576)
    x[5, 100] = float("nan")
    with torch.inference_mode():
        batch = dense_call(layer, x)
        for r in (0, 8, 36):
            assert torch.equal(dense_call(layer, x[r : r + 1])[0], batch[r])
        want = layer.reference_forward(x)
    assert batch[5].isnan().all()
    rows = [r for r in range(37) if r != 5]
    assert relative_error(batch[rows], want[rows]) < TOLERANCE


def test_autograd_and_other_dtypes_keep_the_reference(monkeypatch):
    layer = random_layer(64, 32, 32, False, seed=2)
    x = torch.randn(REFERENCE_MIN_TOKENS, 64)
    calls = record_kernel_calls(monkeypatch)
    torch.testing.assert_close(layer(x), layer.reference_forward(x), rtol=0, atol=0)  # autograd on
    with torch.inference_mode():
        layer(x.to(torch.bfloat16))
    assert not calls


def test_the_kernel_refuses_operands_that_do_not_fit(cpu_ops):
    layer = random_layer(64, 32, 32, False, seed=3)
    zeros = unpack_zeros(layer.qzeros, layer.n_blocks).float()
    ops = cpu_ops
    codes = layer.qweight.reshape(32, -1)
    with pytest.raises(RuntimeError, match="covering x's K"):
        ops.int4_dense_linear(torch.randn(2, 65), codes, layer.scales, zeros, 32, None)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.int4_dense_linear(torch.randn(2, 64), codes, layer.scales, zeros, 12, None)
    with pytest.raises(RuntimeError, match="float32"):
        ops.int4_dense_linear(torch.randn(2, 64), codes, layer.scales.half(), zeros, 32, None)


def test_the_kept_zero_points_follow_the_buffer():
    layer = random_layer(64, 32, 32, False, seed=4)
    x = torch.randn(REFERENCE_MIN_TOKENS, 64)
    with torch.inference_mode():
        layer(x)
        layer.qzeros.copy_(torch.full_like(layer.qzeros, 0x55))  # every zero point 5, in place
        assert relative_error(layer(x), layer.reference_forward(x)) < TOLERANCE
