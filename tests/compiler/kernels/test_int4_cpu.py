"""torch's INT4 CPU kernel (``compiler/kernels/int4_cpu.py``) against the dequantize reference
(``Int4Linear.reference_forward``), on fresh random inputs; relative errors are printed (-s)."""
from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
from numerics import relative_error

from compiler.formats.int4 import Int4Linear
from compiler.kernels.int4_cpu import (
    KERNEL,
    REFERENCE_MIN_TOKENS,
    int4_cpu_matmul,
    kernel_unavailable_reason,
    pack_for_cpu,
)
from compiler.quant.int4 import SYMMETRIC_ZERO

pytestmark = pytest.mark.skipif(kernel_unavailable_reason() is not None,
                                reason=f"no INT4 CPU kernel here: {kernel_unavailable_reason()}")

# The kernel rounds activations, scales, float zeros and its output to bfloat16 (module docstring);
# measured ~3e-3 (float32 / float16 activations) and ~3.6e-3 (bfloat16, whose reference rounds too).
TOLERANCE = 8e-3
SHAPES = [(576, 1536), (1536, 576), (576, 192)]  # SmolLM2's MLP and k/v widths; 576 % 128 != 0: padded K
CASES = [(k, n, g, zp, m, dtype) for (k, n), g, zp, m, dtype in itertools.product(
    SHAPES, (32, 64, 128, 256), (True, False), (1, 37), (torch.float32, torch.bfloat16, torch.float16))]


def random_layer(k: int, n: int, group: int, zero_point: bool, bias: bool, seed: int) -> Int4Linear:
    torch.manual_seed(seed)
    return Int4Linear.from_float(torch.nn.Linear(k, n, bias=bias), group, zero_point)


@functools.cache
def shared_layer(k: int, n: int, group: int, zero_point: bool) -> Int4Linear:
    """One random layer per shape and format, shared by the token counts and dtypes (quantizing is
    the slow part); callers copy it before casting."""
    return random_layer(k, n, group, zero_point, bias=group in (64, 256), seed=k + n + group)


@pytest.mark.parametrize("k, n, group, zero_point, tokens, dtype", CASES,
                         ids=lambda v: str(v).removeprefix("torch.") if not isinstance(v, bool) else ("asym" if v else "sym"))
def test_kernel_matches_reference(k, n, group, zero_point, tokens, dtype):
    layer = copy.deepcopy(shared_layer(k, n, group, zero_point)).to(dtype)  # scales and bias in the model dtype
    assert layer.kernel == KERNEL, layer.kernel_reason
    x = torch.randn(2, tokens, k).to(dtype)  # fresh random inputs, with a leading batch dim
    got, ref = layer(x), layer.reference_forward(x)
    assert got.dtype == dtype and got.shape == (2, tokens, n)
    rel = relative_error(got, ref)
    print(f"INT4 CPU kernel K={k} N={n} g{group} {'asym' if zero_point else 'sym'} {tokens} tok {dtype}: relative error {rel:.2e}")
    assert rel < TOLERANCE


@pytest.mark.parametrize("k, group, zero_point", [(256, 32, True), (576, 64, True), (576, 128, False), (200, 256, True)])
def test_kernel_weights_equal_the_dequantized_weight_bit_for_bit(k, group, zero_point):
    """With power-of-two scales every value on the kernel's path is exact in bfloat16 — s, z' = (8 - z)·s,
    (q - 8)·s + z' and the output — so one-hot activations must return the reference weight exactly:
    the codes, nibble order, zero points, group boundaries and K padding map without any rounding."""
    torch.manual_seed(k + group)
    n = 48  # not a multiple of the kernel's 64-column block: its tail path too
    layer = random_layer(k, n, group, zero_point, bias=False, seed=k + group)
    layer.scales.copy_(2.0 ** torch.randint(-9, -2, layer.scales.shape))
    codes, zeros = layer.codes()
    if zero_point:
        assert (zeros != SYMMETRIC_ZERO).any()  # the z' = (8 - z)·s mapping is exercised
    pack = pack_for_cpu(codes, layer.scales, zeros, group)
    eye = torch.eye(k)
    got = torch.cat([int4_cpu_matmul(eye[i:i + 64], pack) for i in range(0, k, 64)])  # [K, N] = W.T
    torch.testing.assert_close(got, layer.dequantized_weight().t(), rtol=0, atol=0)


def test_kernel_adds_bias_and_pads_activations():
    """K = 200 packs to 256 (policy "pad"); the padded codes are the zero point, the padded activations zero."""
    layer = random_layer(200, 64, 128, True, bias=True, seed=5)
    assert layer.n_blocks * layer.group_size == 256
    x = torch.randn(3, 200)
    rel = relative_error(layer(x), layer.reference_forward(x))
    print(f"INT4 CPU kernel padded K 200 -> 256 with bias: relative error {rel:.2e}")
    assert rel < TOLERANCE
    with torch.no_grad():
        layer.bias.fill_(100.0)
    assert relative_error(layer(x), layer.reference_forward(x)) < TOLERANCE


def test_many_tokens_run_the_reference():
    layer = random_layer(64, 32, 32, True, bias=False, seed=0)
    x = torch.randn(REFERENCE_MIN_TOKENS, 64)
    torch.testing.assert_close(layer(x), layer.reference_forward(x), rtol=0, atol=0)
    assert layer(x[:-1]).sub(layer.reference_forward(x[:-1])).abs().max() > 0  # one fewer: the kernel's rounding
