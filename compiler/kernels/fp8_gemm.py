"""W8A8 FP8 matrix multiply: ``y = (a * a_scale[:, None]) @ (b * b_scale[:, None]).T + bias``.

Three implementations of one contract, all compared in tests on fresh random inputs:

    a        FP8 [M, K]  activations          a_scale  float32 [M] (per token), [M, K/G] (per token
                                                       and group of G columns) or [1]
    b        FP8 [N, K]  weight (Linear layout) b_scale  float32 [N] (per channel) or [1]
    bias     [N] or None                        -> y [M, N] in ``out_dtype``

- ``dequant``: the reference, dequantize to float32 and matmul (runs anywhere);
- ``scaled_mm``: ``torch._scaled_mm`` (CPU and H100 in torch 2.13), accumulating in float32;
- ``triton``: the OpenAI Triton kernel in ``compiler.kernels.fp8`` (H100; CPU via TRITON_INTERPRET=1).

``fp8_gemm`` picks by device: Triton on CUDA, ``_scaled_mm`` on the CPU (the reference for group
scales), the reference on anything else. With no FP8 arithmetic on a CPU, both ``_scaled_mm`` and
dequantize-matmul are slower than a float32 matmul (docs/notes/2026-11-fp8-gemm-cpu.md: 2.3-3.6x),
most of it the weight's dequantization on every call; so ``Fp8Linear`` on the CPU dequantizes its
weight once (``dequantize_weight``, kept beside the FP8 codes) and runs ``float_weight_gemm``, the
reference's own arithmetic on that copy: the same float32 products and sums, so the same output
bit for bit. It costs 4 bytes per weight (float32) on top of the codes' one;
``QCOMPILE_FP8_CPU_FLOAT_WEIGHT=0`` turns it off for a process (memory over speed). The serving
engine also packs that copy (``pack_cpu_weight``, 4 bytes more, ``dense_cpu.pack_weight``), which
batches of ``packed_from_rows()`` rows or more multiply by: float32 still, the sums in another order
(~1e-7 relative), as its float linears.
The activations' quantization on the CPU is one C++ op (``fp8_fake_quant_rows``,
``compiler/kernels/cpu_ext.py``), bit for bit the torch ops of ``compiler/quant/fp8.py``.

Where the CPU has AVX512-BF16, a float32 model's forward outside autograd skips the copy altogether:
``fp8_linear_codes`` (``compiler/kernels/cpu_ext.py``) multiplies the activation codes by the weight
codes in a bfloat16 dot product (FP8 values are exact in bfloat16, their products in float32) and
applies both scales to the float32 sums: within ~1e-7 of the reference (the roundings in another
order), 1 byte read per weight, and no copy kept. The copy above serves the other CPUs, autograd,
and ``QCOMPILE_FP8_CPU_CODES=0``.

Why float32 and not the model's dtype: an E4M3 code has 4 significant bits and a float32 scale
24, so their product needs up to 28 and is rounded even in float32 — the reference rounds it the
same way, which is why the copy must be made with the reference's expression. In bfloat16 (8
bits) the product would be rounded further unless the scale is a power of two, changing the numerics.
"""
from __future__ import annotations

import torch

from compiler.kernels.dense_cpu import dense
from compiler.quant.fp8 import to_float32

def dequantize_weight(b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """FP8 weight [N, K] and its scales [N] or [1] -> the float32 weight the reference multiplies by."""
    return to_float32(b) * b_scale.float()[:, None]


def dequantize_activations(a, a_scale) -> torch.Tensor:
    """FP8 activations ``a`` [M, K] with their scales (as in ``fp8_gemm``) -> float32 [M, K]."""
    sa = a_scale.float()
    sa = sa.repeat_interleave(a.shape[1] // sa.shape[1], dim=1) if sa.dim() == 2 else sa[:, None]
    return to_float32(a) * sa


def float_weight_gemm(a, a_scale, w, bias=None, out_dtype=torch.float32) -> torch.Tensor:
    """``dequant_gemm`` on a weight already dequantized by ``dequantize_weight``: FP8 activations
    ``a`` [M, K] with their scales (as in ``fp8_gemm``), float32 ``w`` [N, K]."""
    return float_gemm(dequantize_activations(a, a_scale), w, bias, out_dtype)


def float_gemm(a, w, bias=None, out_dtype=torch.float32, packed=None) -> torch.Tensor:
    """The reference's matmul of dequantized activations ``a`` and weight ``w`` (float32 both);
    ``packed``: ``w`` packed (``compiler/kernels/dense_cpu.py``), for batches of rows."""
    return dense(a, w, None if bias is None else bias.float(), packed).to(out_dtype)


def dequant_gemm(a, a_scale, b, b_scale, bias=None, out_dtype=torch.float32) -> torch.Tensor:
    """Reference: dequantize both operands to float32, then an ordinary matmul."""
    return float_weight_gemm(a, a_scale, dequantize_weight(b, b_scale), bias, out_dtype)


def _rowwise(scale: torch.Tensor, n: int) -> torch.Tensor:
    return scale.float().expand(n).contiguous() if scale.numel() == 1 else scale.float().contiguous()


def scaled_mm_gemm(a, a_scale, b, b_scale, bias=None, out_dtype=torch.float32) -> torch.Tensor:
    """``torch._scaled_mm``: per-tensor scales when both are scalars, else row-wise (expanding a scalar)."""
    if a_scale.dim() == 2:
        raise ValueError("torch._scaled_mm takes no per-group activation scales; use the dequant or triton kernel")
    if a_scale.numel() == 1 and b_scale.numel() == 1:
        sa, sb = a_scale.float().reshape(()), b_scale.float().reshape(())
    else:
        # _scaled_mm takes either two scalars or [M, 1] and [1, N]; mixed granularity is expanded.
        sa, sb = _rowwise(a_scale, a.shape[0])[:, None], _rowwise(b_scale, b.shape[0])[None, :]
    # CUDA's row-wise scaling writes bf16 only (accumulating in float32); the CPU writes float32.
    mm_dtype = torch.bfloat16 if a.is_cuda and sa.dim() else torch.float32
    y = torch._scaled_mm(a.contiguous(), b.contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=mm_dtype)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def triton_gemm(a, a_scale, b, b_scale, bias=None, out_dtype=torch.float32) -> torch.Tensor:
    from compiler.kernels.fp8 import (
        triton_fp8_gemm,  # triton is imported only where it runs
    )

    return triton_fp8_gemm(a, a_scale, b, b_scale, bias, out_dtype)


FP8_KERNELS = {"dequant": dequant_gemm, "scaled_mm": scaled_mm_gemm, "triton": triton_gemm}


def select_kernel(device: torch.device, grouped: bool = False) -> str:
    """The kernel ``fp8_gemm`` runs on ``device`` (``grouped``: a_scale per token and column group,
    which ``_scaled_mm`` does not take)."""
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and not grouped:
        return "scaled_mm"
    return "dequant"


def fp8_gemm(a, a_scale, b, b_scale, bias=None, out_dtype=torch.float32, kernel: str | None = None) -> torch.Tensor:
    """W8A8 FP8 GEMM with the kernel for ``a``'s device (or the one named)."""
    return FP8_KERNELS[kernel or select_kernel(a.device, a_scale.dim() == 2)](a, a_scale, b, b_scale, bias, out_dtype)
