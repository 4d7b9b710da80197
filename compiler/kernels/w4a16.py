"""W4A16 GEMM in OpenAI Triton: y = x @ dequant(W)^T (+ bias), reading ``Int4Linear``'s packed
MatMulNBits layout directly (see ``compiler/formats/int4.py``).

Within a row the blocks are contiguous, so element k of row n sits in byte ``n * Kp/2 + k // 2``
(low nibble for even k), its scale at ``n * n_blocks + k // g`` and its zero point in byte
``n * ceil(n_blocks/2) + (k // g) // 2`` (low nibble for even blocks). K may be padded up to
Kp = n_blocks * g (``group_size_policy = "pad"``): the kernel masks x beyond K to zero, so the
padded codes never contribute.

Each program computes a [BLOCK_M, BLOCK_N] tile of y over its share of K (``split_k`` programs
share one tile's K range and add their partial sums atomically, which gives decode-sized M enough
programs to keep the memory system busy). BLOCK_K divides the group size, so a K tile lies in one
group: its scales and zero points are one [BLOCK_N] row each, loaded once per tile. Packed bytes
are loaded once as [BLOCK_K/2, BLOCK_N] and split into low nibbles (even k) and high nibbles (odd
k), which meet x's even and odd columns in two ``tl.dot`` calls, so no interleaving is needed.
For many tokens the GEMM is compute-bound and cuBLAS on the dequantized weight is faster than any
tile of this kernel: from ``dispatch.DEQUANT_MIN_TOKENS`` tokens ``Int4Linear.forward`` dequantizes W with
``w4_dequantize`` (one pass: read the packed bytes, write W in x's dtype) and calls ``F.linear``.

Tested on the CPU with ``TRITON_INTERPRET=1`` against the torch reference (``Int4Linear.forward``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _group_scale_zero(scale_ptr, zero_ptr, offs_n, mask_n, n_blocks, zero_stride, blk):
    """Scales and zero points [BLOCK_N] (float32) of rows ``offs_n`` in group ``blk``."""
    scale = tl.load(scale_ptr + offs_n * n_blocks + blk, mask=mask_n, other=0.0).to(tl.float32)
    zbyte = tl.load(zero_ptr + offs_n * zero_stride + blk // 2, mask=mask_n, other=0)
    return scale, ((zbyte >> ((blk % 2) * 4)) & 0xF).to(tl.float32)


@triton.jit
def _dequant_nibbles(byte, scale, zero, dtype: tl.constexpr):
    """Packed bytes -> the weights of their low (even k) and high (odd k) nibbles in ``dtype``;
    (code - zero) * scale is exact in float32, so one rounding to ``dtype``, as in the reference."""
    w_lo = (((byte & 0xF).to(tl.float32) - zero) * scale).to(dtype)
    w_hi = (((byte >> 4).to(tl.float32) - zero) * scale).to(dtype)
    return w_lo, w_hi


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, scale_ptr, zero_ptr, bias_ptr, y_ptr,
                  M, N, K, n_blocks, zero_stride, stride_xm, stride_ym,
                  GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, BLOCK_K // 2)
    mask_m, mask_n = offs_m < M, offs_n < N
    row_bytes = n_blocks * (GROUP // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, n_blocks * GROUP, BLOCK_K * SPLIT_K):
        even = k0 + 2 * half
        x_row = x_ptr + offs_m[:, None] * stride_xm
        # x beyond K (the zero padding of the last group) reads as 0.
        x_even = tl.load(x_row + even[None, :], mask=mask_m[:, None] & (even[None, :] < K), other=0.0)
        x_odd = tl.load(x_row + even[None, :] + 1, mask=mask_m[:, None] & (even[None, :] + 1 < K), other=0.0)
        byte = tl.load(qw_ptr + offs_n[None, :] * row_bytes + (k0 // 2 + half)[:, None], mask=mask_n[None, :], other=0)
        scale, zero = _group_scale_zero(scale_ptr, zero_ptr, offs_n, mask_n, n_blocks, zero_stride, k0 // GROUP)
        w_lo, w_hi = _dequant_nibbles(byte, scale[None, :], zero[None, :], x_ptr.dtype.element_ty)
        acc = tl.dot(x_even, w_lo, acc)
        acc = tl.dot(x_odd, w_hi, acc)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:  # y is a float32 buffer of partial sums; the caller adds the bias and casts
        tl.atomic_add(y_ptrs, acc, mask=mask)


@triton.jit
def _dequant_kernel(qw_ptr, scale_ptr, zero_ptr, w_ptr, N, K, n_blocks, zero_stride,
                    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, BLOCK_K // 2)
    k0 = pid_k * BLOCK_K
    mask_n = offs_n < N
    byte = tl.load(qw_ptr + offs_n[:, None] * (n_blocks * (GROUP // 2)) + (k0 // 2 + half)[None, :],
                   mask=mask_n[:, None], other=0)  # [BLOCK_N, BLOCK_K/2]
    scale, zero = _group_scale_zero(scale_ptr, zero_ptr, offs_n, mask_n, n_blocks, zero_stride, k0 // GROUP)
    w_lo, w_hi = _dequant_nibbles(byte, scale[:, None], zero[:, None], w_ptr.dtype.element_ty)
    even = k0 + 2 * half
    out = w_ptr + offs_n[:, None] * K + even[None, :]
    tl.store(out, w_lo, mask=mask_n[:, None] & (even[None, :] < K))  # columns past K are padding
    tl.store(out + 1, w_hi, mask=mask_n[:, None] & (even[None, :] + 1 < K))


def w4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, in_features: int,
                  group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """W [N, in_features] in ``dtype`` from the packed layout (``Int4Linear.dequantized_weight``'s values)."""
    n, n_blocks, _ = qweight.shape
    w = torch.empty(n, in_features, dtype=dtype, device=qweight.device)
    block_k = min(group_size, 128)
    grid = (triton.cdiv(n, 32), n_blocks * group_size // block_k)
    _dequant_kernel[grid](qweight.contiguous(), scales.contiguous(), qzeros.contiguous(), w, n, in_features,
                          n_blocks, qzeros.shape[1], GROUP=group_size, BLOCK_N=32, BLOCK_K=block_k)
    return w


def default_config(m: int, n: int, k: int, group_size: int) -> dict:
    """Tiles and K split for M tokens, N outputs, K inputs, picked from the H200 sweep of
    benchmarks/gpu_kernels.py (its W4A16 table: docs/notes/2026-11-h200-gpu-kernels.md)."""
    block_k = min(group_size, 128)
    if m > 16:
        return {"block_m": 64, "block_n": 64, "block_k": block_k, "split_k": 1, "num_warps": 4, "num_stages": 3}
    block_n = 128 if n >= 8192 else 64
    tiles = triton.cdiv(n, block_n)
    # split K until there are about two programs per multiprocessor (H100/H200: 132), keeping >= 4 K tiles each
    split_k = max(1, min(264 // tiles, triton.cdiv(k, block_k) // 4))
    return {"block_m": 16, "block_n": block_n, "block_k": block_k, "split_k": split_k, "num_warps": 4, "num_stages": 4}


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                 in_features: int, group_size: int, bias: torch.Tensor | None = None,
                 config: dict | None = None) -> torch.Tensor:
    """x [..., K] @ W^T for W packed as qweight [N, n_blocks, g/2], scales [N, n_blocks],
    qzeros [N, ceil(n_blocks/2)] -> [..., N] in x's dtype. ``config`` overrides ``default_config``."""
    n, n_blocks, _ = qweight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features).contiguous()
    m = x2.shape[0]
    cfg = config or default_config(m, n, in_features, group_size)
    if group_size % cfg["block_k"]:
        raise ValueError(f"block_k {cfg['block_k']} must divide the group size {group_size}")
    split_k = cfg["split_k"]
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device) if split_k > 1 else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg["block_m"]), triton.cdiv(n, cfg["block_n"]), split_k)
    _w4a16_kernel[grid](x2, qweight.contiguous(), scales.contiguous(), qzeros.contiguous(),
                        bias if bias is not None else scales, y, m, n, in_features, n_blocks, qzeros.shape[1],
                        x2.stride(0), y.stride(0), GROUP=group_size, HAS_BIAS=bias is not None, SPLIT_K=split_k,
                        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split_k > 1:
        y = (y + bias.float() if bias is not None else y).to(x.dtype)
    return y.view(*lead, n)
