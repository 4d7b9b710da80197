"""The FP8 GEMM kernels (``compiler/kernels/fp8_gemm.py``, the Triton ones in ``compiler/kernels/fp8.py``)
and the Triton activation cast against the float32 dequantize reference.

The Triton kernels run on ``kernel_device``: compiled on a CUDA GPU (FP8 needs compute capability
8.9 or later), else in Triton's interpreter on the CPU; ``pytest -m gpu`` also runs the CUDA
dispatch (``fp8_gemm``). Bounds on the relative error per device: ``FP8_GEMM_BOUNDS`` (tests/numerics.py).
"""
from __future__ import annotations

import pytest
import torch
from numerics import FP8_GEMM_BOUNDS, relative_error, stable_seed

from compiler.kernels.fp8_gemm import FP8_KERNELS, dequant_gemm, fp8_gemm, select_kernel
from compiler.quant.fp8 import FP8_DTYPES, quantize, quantize_per_token, quantize_per_token_group, weight_scale

DTYPES = list(FP8_DTYPES.values())
GEMM_BOUNDS = FP8_GEMM_BOUNDS
PRECISE_ACC_BOUNDS = {"cpu": 1e-5, "cuda": 1e-3}  # precise_acc promotes partial sums (H200: <= 4.0e-4)


def _operands(m, n, k, a_dtype, b_dtype, granularity, seed):
    """Fresh random FP8 operands; activations reach 1e4, far beyond E4M3's 448 before scaling."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 1e4
    w = torch.randn(n, k, generator=g)
    xq, xs = quantize_per_token(x, a_dtype)
    ws = weight_scale(w, b_dtype, granularity)
    wq = quantize(w, ws[:, None], b_dtype)
    bias = torch.randn(n, generator=g)
    return x, w, xq, xs, wq, ws, bias


@pytest.fixture
def fp8_device(kernel_device) -> str:
    """``kernel_device``, where it can run FP8 Triton kernels."""
    if kernel_device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"FP8 Triton kernels need compute capability 8.9+, this GPU has {torch.cuda.get_device_capability()}")
    return kernel_device


def on(device: str, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


@pytest.mark.parametrize("kernel", ["scaled_mm", "triton"])
@pytest.mark.parametrize("dtypes", [(torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.float8_e5m2, torch.float8_e5m2)])
@pytest.mark.parametrize("granularity", ["per_channel", "per_tensor"])
@pytest.mark.parametrize("shape", [(5, 24, 40), (70, 130, 96)])
def test_kernels_match_dequantize_reference(kernel, dtypes, granularity, shape, fp8_device):
    """``scaled_mm`` is the CPU's kernel (on CUDA it needs 16-aligned shapes and is only benchmarked);
    the Triton kernel runs on ``kernel_device``."""
    device = fp8_device if kernel == "triton" else "cpu"
    bound = GEMM_BOUNDS[device]
    m, n, k = shape
    x, w, xq, xs, wq, ws, bias = _operands(m, n, k, *dtypes, granularity, seed=stable_seed(shape, granularity))
    ref = dequant_gemm(xq, xs, wq, ws, bias)
    assert relative_error(FP8_KERNELS[kernel](*on(device, xq, xs, wq, ws, bias)), ref) < bound
    # static (per-tensor) activation scale too, with values saturating at the format's max
    xs_static = torch.tensor([1e4 / torch.finfo(dtypes[0]).max])
    xq_static = quantize(x, xs_static, dtypes[0])
    ref = dequant_gemm(xq_static, xs_static, wq, ws, None)
    assert torch.isfinite(ref).all()
    assert relative_error(FP8_KERNELS[kernel](*on(device, xq_static, xs_static, wq, ws)), ref) < bound
    # and the reference itself is close to the float product
    assert relative_error(dequant_gemm(xq, xs, wq, ws, bias), x @ w.t() + bias) < 0.1


def test_gemm_bounds_catch_a_wrong_scale():
    """The bounds are far below what one wrong row scale costs (the kernel tests can fail)."""
    _, _, xq, xs, wq, ws, bias = _operands(70, 96, 130, torch.float8_e4m3fn, torch.float8_e4m3fn, "per_channel", 1)
    wrong = xs.clone()
    wrong[3] *= 2  # one token of 70 scaled wrong
    err = relative_error(dequant_gemm(xq, wrong, wq, ws, bias), dequant_gemm(xq, xs, wq, ws, bias))
    assert err > 10 * GEMM_BOUNDS["cuda"], err


def test_kernel_selection_by_device():
    assert select_kernel(torch.device("cpu")) == "scaled_mm"
    assert select_kernel(torch.device("cuda")) == "triton"
    assert select_kernel(torch.device("meta")) == "dequant"
    assert select_kernel(torch.device("cpu"), grouped=True) == "dequant"  # _scaled_mm takes no group scales
    assert select_kernel(torch.device("cuda"), grouped=True) == "triton"


def test_fp8_gemm_default_dispatch_matches_reference():
    _, _, xq, xs, wq, ws, bias = _operands(9, 17, 33, torch.float8_e4m3fn, torch.float8_e4m3fn, "per_channel", 3)
    assert relative_error(fp8_gemm(xq, xs, wq, ws, bias), dequant_gemm(xq, xs, wq, ws, bias)) < 1e-5


@pytest.mark.parametrize("precise_acc", [False, True])
def test_triton_gemm_tile_configs_match_reference(precise_acc, fp8_device):
    from compiler.kernels.fp8 import triton_fp8_gemm

    _, _, xq, xs, wq, ws, bias = _operands(37, 80, 160, torch.float8_e4m3fn, torch.float8_e4m3fn, "per_channel", 5)
    ref = dequant_gemm(xq, xs, wq, ws, bias)
    bound = (PRECISE_ACC_BOUNDS if precise_acc else GEMM_BOUNDS)[fp8_device]
    for block_m, block_n, block_k in [(16, 32, 32), (32, 64, 128)]:
        cfg = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": 2,
               "precise_acc": precise_acc}
        assert relative_error(triton_fp8_gemm(*on(fp8_device, xq, xs, wq, ws, bias), config=cfg), ref) < bound


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, k", [(3, 50), (9, 5000)])  # 5000 > the kernel's 4096-wide chunk
@pytest.mark.parametrize("shifted", [False, True])
def test_triton_activation_cast_matches_torch(dtype, rows, k, shifted, fp8_device):
    """Scales bitwise, and the saturated values before rounding, rounded by torch, give torch's codes
    bitwise; with an input shift, those of ``x - shift`` (Fp8Linear's input_shift, fused into the cast).
    On a GPU the codes the kernel writes are torch's bitwise too; Triton's interpreter rounds float32
    to FP8 in numpy, not exactly to nearest-even, so there only the values before rounding are compared."""
    from compiler.kernels.fp8 import triton_quantize_rows

    g = torch.Generator().manual_seed(k)
    x = torch.randn(rows, k, generator=g) * 3
    shift = torch.randn(k, generator=g) * 5 if shifted else None
    x[1, :7] = 1e6
    x[0] = shift if shifted else 0  # a row all zero (after any shift) gets the minimum scale, not NaN
    centred = x - shift if shifted else x
    static = torch.tensor([1e-3])  # far too small: everything beyond ±max saturates
    xd, shift_d = on(fp8_device, x, shift)
    for scale, (q_ref, s_ref) in ((None, quantize_per_token(centred, dtype)),
                                  (static, (quantize(centred, static, dtype), static))):
        pre_rounding = torch.empty(rows, k, device=fp8_device)
        _, s = triton_quantize_rows(xd, dtype, on(fp8_device, scale)[0], out=pre_rounding, shift=shift_d)
        assert torch.equal(s.cpu(), s_ref)
        pre_rounding = pre_rounding.cpu()
        assert torch.isfinite(pre_rounding).all() and pre_rounding.abs().max() <= torch.finfo(dtype).max
        assert torch.equal(pre_rounding.to(dtype).view(torch.uint8), q_ref.view(torch.uint8))
        q, _ = triton_quantize_rows(xd, dtype, on(fp8_device, scale)[0], shift=shift_d)
        assert q.dtype == dtype and torch.isfinite(q.float()).all()
        if fp8_device == "cuda":
            assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("kernel", ["dequant", "triton"])
@pytest.mark.parametrize("group", [32, 96])  # 96: the Triton kernel steps K by 32 inside each group
def test_group_scaled_activations_match_a_hand_dequantized_product(kernel, group, fp8_device):
    g = torch.Generator().manual_seed(group)
    x, w = torch.randn(21, 192, generator=g), torch.randn(40, 192, generator=g)
    x[:, 5] *= 1e5  # one outlier channel: only its own group's scales grow
    xq, xs = quantize_per_token_group(x, torch.float8_e4m3fn, group)
    assert xs.shape == (21, 192 // group)
    wq, ws = quantize(w, w.abs().amax(1, keepdim=True) / 448, torch.float8_e4m3fn), w.abs().amax(1) / 448
    by_hand = (xq.float().view(21, -1, group) * xs[..., None]).view(21, 192) @ (wq.float() * ws[:, None]).t()
    device = fp8_device if kernel == "triton" else "cpu"
    assert relative_error(FP8_KERNELS[kernel](*on(device, xq, xs, wq, ws)), by_hand) < GEMM_BOUNDS[device]
    assert relative_error(fp8_gemm(xq, xs, wq, ws), by_hand) < 1e-5  # the CPU default takes group scales too
    with pytest.raises(ValueError, match="no per-group activation scales"):
        FP8_KERNELS["scaled_mm"](xq, xs, wq, ws)
    # finer scales: per token, the outlier pushes the token's other channels into E4M3's subnormals;
    # per group, only the channels of its own group
    rest = slice(group, None)
    pq, ps = quantize_per_token(x, torch.float8_e4m3fn)
    per_token = relative_error((pq.float() * ps[:, None])[:, rest], x[:, rest])
    per_group = relative_error((xq.float().view(21, -1, group) * xs[..., None]).view(21, 192)[:, rest], x[:, rest])
    assert per_group < 0.05 < per_token


@pytest.mark.gpu(capability=(8, 9))
@pytest.mark.parametrize("grouped", [False, True])
def test_fp8_gemm_dispatch_on_cuda(grouped):
    """``fp8_gemm`` on CUDA tensors runs the Triton kernel (per-token and per-group scales)."""
    _, _, xq, xs, wq, ws, bias = _operands(33, 96, 192, torch.float8_e4m3fn, torch.float8_e4m3fn, "per_channel", 7)
    if grouped:
        x = torch.randn(33, 192, generator=torch.Generator().manual_seed(8))
        xq, xs = quantize_per_token_group(x, torch.float8_e4m3fn, 64)
    assert select_kernel(torch.device("cuda"), grouped) == "triton"
    ref = dequant_gemm(xq, xs, wq, ws, bias)
    y = fp8_gemm(*on("cuda", xq, xs, wq, ws, bias))
    assert y.is_cuda and relative_error(y, ref) < GEMM_BOUNDS["cuda"]
