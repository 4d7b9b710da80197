"""The Triton W4A16 kernels against a float64 reference (the dequantized weight times x) on fresh
random inputs, on ``kernel_device``: compiled on a CUDA GPU, else Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton). ``pytest -m gpu`` also
runs ``Int4Linear.forward``'s CUDA dispatch (fused kernel, or dequantize + cuBLAS) in each dtype.

Bounds on the relative error (||out - ref|| / ||ref||), per device and dtype, and why:
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from numerics import relative_error  # noqa: E402

from compiler.formats.int4 import Int4Linear  # noqa: E402
from compiler.kernels.dispatch import DEQUANT_MIN_TOKENS  # noqa: E402

BOUNDS = {
    # The interpreter sums in numpy float32.
    ("cpu", torch.float32): 1e-5,
    # Compiled, tl.dot rounds float32 operands to TF32 (10-bit mantissa) on Ampere and later.
    ("cuda", torch.float32): 3e-3,
    # W rounded to the activations' dtype: the H200 run of benchmarks/gpu_kernels.py measured
    # 2.1e-4..2.2e-4 (float16) and 1.6e-3..1.7e-3 (bfloat16) on SmolLM2 and Llama-8B shapes
    # (docs/data/gpu_kernels_h200.json); about 4x headroom.
    ("cuda", torch.float16): 1e-3,
    ("cuda", torch.bfloat16): 6e-3,
}

SPLIT_K = {"block_m": 16, "block_n": 32, "block_k": 32, "split_k": 3, "num_warps": 4, "num_stages": 2}
WIDE = {"block_m": 32, "block_n": 64, "block_k": 128, "split_k": 1, "num_warps": 4, "num_stages": 2}
CASES = [
    # m, K, N, g, zero_point, bias, seed, config (None: default_config)
    (5, 128, 96, 32, True, False, 0, None),
    (17, 256, 64, 64, True, True, 1, None),
    (3, 256, 80, 128, False, False, 2, None),
    (8, 512, 64, 256, True, False, 3, None),
    (9, 96, 64, 64, True, True, 4, None),     # K not divisible by g: padded to 128 (policy "pad")
    (4, 200, 48, 128, False, False, 5, None),  # padded to 256, symmetric, odd n_blocks
    (1, 576, 64, 128, True, False, 6, None),   # SmolLM2's hidden size under "pad"
    (2, 576, 40, 64, True, True, 7, SPLIT_K),  # K split over 3 programs (atomic float32 sums), bias after
    (1, 200, 64, 128, True, False, 8, SPLIT_K),  # more splits than some tiles have K blocks
    (33, 384, 70, 128, True, True, 9, WIDE),   # block_k = g, N not a multiple of block_n
]


def layer_and_input(m, k, n, g, zero_point, bias, seed):
    torch.manual_seed(seed)
    q = Int4Linear.from_float(torch.nn.Linear(k, n, bias=bias), g, zero_point)
    x = torch.randn(2, m, k)  # fresh random inputs, with a leading batch dim
    return q, x


def reference(q: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """float64: x (as the kernel sees it) times the dequantized weight (as stored), plus the bias."""
    y = x.double().cpu() @ q.dequantized_weight().double().cpu().t()
    return y + q.bias.double().cpu() if q.bias is not None else y


@pytest.mark.parametrize("case", CASES, ids=lambda c: "m{}-k{}-n{}-g{}{}{}{}".format(
    *c[:4], "" if c[4] else "-sym", "-bias" if c[5] else "", "-cfg" if c[7] else ""))
def test_w4a16_kernel_matches_reference(case, kernel_device):
    from compiler.kernels.w4a16 import w4a16_matmul

    *shape, config = case
    q, x = layer_and_input(*shape)
    ref = reference(q, x)
    q, x = q.to(kernel_device), x.to(kernel_device)
    out = w4a16_matmul(x, q.qweight, q.scales, q.qzeros, q.in_features, q.group_size, q.bias, config)
    err = relative_error(out, ref)
    print(f"W4A16 kernel {case} on {kernel_device}: relative error {err:.2e}")
    assert out.shape == (2, shape[0], shape[2]) and out.dtype == torch.float32
    assert err < BOUNDS[(kernel_device, torch.float32)]  # NaN fails this comparison too


def test_the_bound_catches_one_wrong_code_per_group(kernel_device):
    """The bound is far below what one wrong code per group costs (the test can fail)."""
    q, x = layer_and_input(5, 128, 96, 32, True, False, 0)
    ref = reference(q, x)
    codes, zero = q.codes()
    wrong = Int4Linear.from_codes(codes ^ (torch.arange(codes.shape[1]) % 32 == 0).to(torch.uint8), q.scales, zero,
                                  q.in_features, q.group_size, q.zero_point, q.bias)
    assert relative_error(wrong(x), ref) > 10 * BOUNDS[(kernel_device, torch.float32)]  # 0.04 against 1e-5 or 3e-3


def test_w4a16_block_k_must_divide_the_group():
    from compiler.kernels.w4a16 import w4a16_matmul

    q = Int4Linear.from_float(torch.nn.Linear(128, 32), 64)
    with pytest.raises(ValueError, match="must divide the group size 64"):
        w4a16_matmul(torch.randn(2, 128), q.qweight, q.scales, q.qzeros, 128, 64, None, {**WIDE, "block_k": 128})


@pytest.mark.parametrize("k, n, g, zero_point", [(576, 40, 128, True), (200, 33, 64, False), (256, 64, 256, True)])
def test_w4_dequantize_matches_reference(k, n, g, zero_point, kernel_device):
    """The large-M path's dequantize kernel gives Int4Linear.dequantized_weight's values: exactly in
    float32, and in bfloat16 bitwise on a GPU; in the interpreter bfloat16 within one step, as it
    rounds float32 to bfloat16 in numpy, not to nearest-even as GPUs do."""
    from compiler.kernels.w4a16 import w4_dequantize

    torch.manual_seed(k + n)
    q = Int4Linear.from_float(torch.nn.Linear(k, n), g, zero_point)
    for dtype in (torch.float32, torch.bfloat16):
        q.scales = q.scales.to(dtype)  # as in a model of that dtype
        ref = q.dequantized_weight()
        w = w4_dequantize(q.qweight.to(kernel_device), q.scales.to(kernel_device), q.qzeros.to(kernel_device),
                          k, g, dtype).cpu()
        assert w.shape == (n, k) and w.dtype == dtype
        if dtype == torch.float32 or kernel_device == "cuda":
            assert torch.equal(w, ref)
        else:
            assert ((w.float() - ref.float()).abs() <= ref.float().abs() * 2**-7).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 2 * DEQUANT_MIN_TOKENS])  # the fused kernel, then dequantize + cuBLAS
def test_int4_linear_forward_on_cuda(dtype, tokens):
    """Int4Linear.forward's CUDA branch in a model's dtype, against the float64 reference."""
    q, _ = layer_and_input(1, 576, 192, 64, True, True, tokens)
    x = torch.randn(tokens, 576).to(dtype)
    q = q.to("cuda")
    q.scales, q.bias = q.scales.to(dtype), q.bias.to(dtype)
    ref = reference(q, x)  # of x and W as rounded to the model's dtype
    out = q(x.to("cuda"))
    assert out.is_cuda and out.dtype == dtype and out.shape == (tokens, 192)
    # the dequantize + cuBLAS path in float32 does not use TF32 (torch's default), the fused kernel does
    bound = BOUNDS[("cuda", dtype)] if dtype != torch.float32 or tokens < DEQUANT_MIN_TOKENS else 1e-5
    assert relative_error(out, ref) < bound
