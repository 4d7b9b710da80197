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
scales), the reference on anything else. On the CPU, FP8 saves memory, not time: with no FP8
arithmetic there, both ``_scaled_mm`` and dequantize-matmul are slower than a float32 matmul
(docs/BENCHMARKS.md, "FP8 GEMM on the CPU").
"""
from __future__ import annotations

import torch


def dequant_gemm(a, a_scale, b, b_scale, bias=None, out_dtype=torch.float32) -> torch.Tensor:
    """Reference: dequantize both operands to float32, then an ordinary matmul."""
    sa = a_scale.float()
    sa = sa.repeat_interleave(a.shape[1] // sa.shape[1], dim=1) if sa.dim() == 2 else sa[:, None]
    y = (a.float() * sa) @ (b.float() * b_scale.float()[:, None]).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


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
