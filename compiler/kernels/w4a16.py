"""W4A16 GEMM in OpenAI Triton: y = x @ dequant(W)^T (+ bias), reading ``Int4Linear``'s packed
MatMulNBits layout directly (see ``compiler/int4.py``).

Within a row the blocks are contiguous, so element k of row n sits in byte ``n * Kp/2 + k // 2``
(low nibble for even k), its scale at ``n * n_blocks + k // g`` and its zero point in byte
``n * ceil(n_blocks/2) + (k // g) // 2`` (low nibble for even blocks). K may be padded up to
Kp = n_blocks * g (``group_size_policy = "pad"``): the kernel masks x beyond K to zero, so the
padded codes never contribute.

Tested on the CPU with ``TRITON_INTERPRET=1`` against the torch reference (``Int4Linear.forward``).
"""
from __future__ import annotations

import torch

try:  # triton is optional: CPU-only installs use the torch reference path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _w4a16_kernel(x_ptr, qw_ptr, scale_ptr, zero_ptr, bias_ptr, y_ptr,
                      M, N, K, n_blocks, zero_stride,
                      stride_xm, stride_ym,
                      GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        kp = n_blocks * GROUP
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, kp, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            # x beyond K (the zero padding of the last group) reads as 0.
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=mask_m[:, None] & (offs_k[None, :] < K), other=0.0)
            in_kp = offs_k[:, None] < kp
            wmask = in_kp & mask_n[None, :]
            byte = tl.load(qw_ptr + offs_n[None, :] * (kp // 2) + offs_k[:, None] // 2, mask=wmask, other=0)
            code = (byte >> ((offs_k[:, None] % 2) * 4)) & 0xF  # [BLOCK_K, BLOCK_N]
            blk = offs_k[:, None] // GROUP
            scale = tl.load(scale_ptr + offs_n[None, :] * n_blocks + blk, mask=wmask, other=0.0)
            zbyte = tl.load(zero_ptr + offs_n[None, :] * zero_stride + blk // 2, mask=wmask, other=0)
            zero = (zbyte >> ((blk % 2) * 4)) & 0xF
            w = (code.to(tl.float32) - zero.to(tl.float32)) * scale.to(tl.float32)
            # 16-bit activations meet 16-bit weights on the tensor cores; accumulate in fp32.
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty))
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                 in_features: int, group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T for W packed as qweight [N, n_blocks, g/2], scales [N, n_blocks],
    qzeros [N, ceil(n_blocks/2)] -> [..., N] in x's dtype."""
    if triton is None:
        raise RuntimeError("w4a16_matmul needs the triton package; use Int4Linear.forward's torch path")
    n, n_blocks, _ = qweight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_k = min(group_size, 64)  # divides every allowed group size, so a tile never straddles blocks badly
    grid = (triton.cdiv(m, 16), triton.cdiv(n, 64))
    _w4a16_kernel[grid](x2, qweight.contiguous(), scales.contiguous(), qzeros.contiguous(),
                        bias if bias is not None else scales, y, m, n, in_features, n_blocks, qzeros.shape[1],
                        x2.stride(0), y.stride(0), GROUP=group_size, HAS_BIAS=bias is not None,
                        BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k)
    return y.view(*lead, n)
