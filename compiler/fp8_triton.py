"""The OpenAI Triton W8A8 FP8 GEMM (H100 / sm_90 and later; on the CPU under TRITON_INTERPRET=1).

Each program computes one [BLOCK_M, BLOCK_N] tile of ``y = a @ b.T``: it walks K in BLOCK_K
steps feeding FP8 tiles straight to ``tl.dot`` (the tensor cores' FP8 path on Hopper) with a
float32 accumulator, then applies the row scales of ``a`` and the column scales of ``b`` once
at the end (scales factor out of the K sum), adds the bias and stores in the output dtype.
A per-tensor scale is passed with stride 0, so one kernel serves every granularity.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_gemm_kernel(a_ptr, b_ptr, y_ptr, a_scale_ptr, b_scale_ptr, bias_ptr,
                     M, N, K, stride_am, stride_ak, stride_bn, stride_bk, stride_ym, stride_yn,
                     stride_as, stride_bs, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)  # [BM, BK] fp8
        b = tl.load(b_ptr + rn[None, :] * stride_bn + kk[:, None] * stride_bk,
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)  # [BK, BN] fp8
        acc = tl.dot(a, b, acc)
    sa = tl.load(a_scale_ptr + rm * stride_as, mask=rm < M, other=0.0)
    sb = tl.load(b_scale_ptr + rn * stride_bs, mask=rn < N, other=0.0)
    acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=mask)


def triton_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                    block_m: int = 64, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """y [M, N] = dequant(a [M, K]) @ dequant(b [N, K]).T + bias; scales [M]/[N] or [1] (see fp8_gemm)."""
    M, K = a.shape
    N = b.shape[0]
    a_scale, b_scale = a_scale.float().contiguous(), b_scale.float().contiguous()
    y = torch.empty(M, N, dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _fp8_gemm_kernel[grid](
        a, b, y, a_scale, b_scale, bias if bias is not None else y,
        M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), y.stride(0), y.stride(1),
        0 if a_scale.numel() == 1 else 1, 0 if b_scale.numel() == 1 else 1, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y
