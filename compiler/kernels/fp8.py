"""OpenAI Triton kernels of the W8A8 FP8 path (H100 / sm_90 and later; CPU under TRITON_INTERPRET=1).

The GEMM:

Each program computes one [BLOCK_M, BLOCK_N] tile of ``y = a @ b.T``: it walks K in BLOCK_K
steps feeding FP8 tiles straight to ``tl.dot`` (the tensor cores' FP8 path on Hopper) with a
float32 accumulator, then applies the row scales of ``a`` and the column scales of ``b`` once
at the end (scales factor out of the K sum), adds the bias and stores in the output dtype.
A per-tensor scale is passed with stride 0, so one kernel serves every granularity. With
activation scales per token and group of A_GROUP columns, BLOCK_K divides A_GROUP, so each K step
lies in one group: its partial product is scaled by that group's [BLOCK_M] scales as it is added.
Hopper's FP8 tensor cores accumulate with fewer than float32's bits; ``precise_acc`` promotes the
partial sums into the float32 accumulator every BLOCK_K products (as DeepSeek-V3 does every 128),
which bounds the error growth in K at a 35–45% cost in speed (docs/BENCHMARKS.md, "GPU kernels on an H200").

The activation cast (``triton_quantize_rows``): one program per row finds the row's absolute
maximum (dynamic) or reads the static scale, then writes the saturated FP8 codes, in one kernel
instead of torch's five (abs, amax, divide, clamp, cast). An input shift (``Fp8Linear``'s
channel means) is subtracted as the row is read, in float32, instead of in a pass of its own.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from compiler.quant.fp8 import MIN_SCALE, fp8_max


@triton.jit
def _fp8_gemm_kernel(a_ptr, b_ptr, y_ptr, a_scale_ptr, b_scale_ptr, bias_ptr,
                     M, N, K, stride_am, stride_ak, stride_bn, stride_bk, stride_ym, stride_yn,
                     stride_as, stride_bs, HAS_BIAS: tl.constexpr, PRECISE_ACC: tl.constexpr, A_GROUP: tl.constexpr,
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
        if A_GROUP:  # scale this K step's partial product by its group's activation scales
            sa_k = tl.load(a_scale_ptr + rm * stride_as + k0 // A_GROUP, mask=rm < M, other=0.0)
            acc += tl.dot(a, b) * sa_k[:, None]
        elif PRECISE_ACC:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, b, acc)
    if not A_GROUP:
        acc = acc * tl.load(a_scale_ptr + rm * stride_as, mask=rm < M, other=0.0)[:, None]
    acc = acc * tl.load(b_scale_ptr + rn * stride_bs, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=mask)


def default_config(m: int, n: int, k: int) -> dict:
    """Tile sizes for an [M, K] x [K, N] product, picked from the H200 sweep of
    benchmarks/gpu_kernels.py (docs/BENCHMARKS.md, "GPU kernels on an H200")."""
    if m <= 64:  # decode: bound by reading the weight; long K tiles, many programs
        return {"block_m": 64, "block_n": 64, "block_k": 256, "num_warps": 4, "num_stages": 3}
    if triton.cdiv(m, 128) * triton.cdiv(n, 128) < 64:  # too few big tiles to fill the GPU
        return {"block_m": 64, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 4}
    return {"block_m": 128, "block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 4 if m < 1024 else 3}


def triton_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                    config: dict | None = None) -> torch.Tensor:
    """y [M, N] = dequant(a [M, K]) @ dequant(b [N, K]).T + bias; scales [M] or [M, K/G], [N], or [1]
    (see fp8_gemm). ``config`` overrides ``default_config`` (block_m/n/k, num_warps, num_stages;
    precise_acc, off unless given); with group scales block_k shrinks to the largest power of two dividing G."""
    M, K = a.shape
    N = b.shape[0]
    cfg = dict(config or default_config(M, N, K))
    a_scale, b_scale = a_scale.float().contiguous(), b_scale.float().contiguous()
    group = K // a_scale.shape[1] if a_scale.dim() == 2 else 0
    if group:
        cfg["block_k"] = min(cfg["block_k"], group & -group)  # a K step never straddles two groups
    y = torch.empty(M, N, dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(M, cfg["block_m"]), triton.cdiv(N, cfg["block_n"]))
    _fp8_gemm_kernel[grid](
        a, b, y, a_scale, b_scale, bias if bias is not None else y,
        M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), y.stride(0), y.stride(1),
        a_scale.stride(0) if group else int(a_scale.numel() > 1), int(b_scale.numel() > 1),
        HAS_BIAS=bias is not None, PRECISE_ACC=cfg.get("precise_acc", False), A_GROUP=group,
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y


@triton.jit
def _load_row_chunk(x_ptr, shift_ptr, row, k0, offs, K, stride_xm, HAS_SHIFT: tl.constexpr):
    x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
    if HAS_SHIFT:
        x -= tl.load(shift_ptr + k0 + offs, mask=k0 + offs < K, other=0.0)
    return x


@triton.jit
def _quantize_rows_kernel(x_ptr, shift_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, FP8_MAX: tl.constexpr,
                          MIN_SCALE: tl.constexpr, DYNAMIC: tl.constexpr, HAS_SHIFT: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if DYNAMIC:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = _load_row_chunk(x_ptr, shift_ptr, row, k0, offs, K, stride_xm, HAS_SHIFT)
            amax = tl.maximum(amax, tl.abs(x))
        # div_rn: IEEE division, as torch on the CPU (Triton's default fp32 division is approximate)
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)
        tl.store(scale_ptr + row, scale)
    else:
        scale = tl.load(scale_ptr)
    for k0 in range(0, K, BLOCK):
        x = _load_row_chunk(x_ptr, shift_ptr, row, k0, offs, K, stride_xm, HAS_SHIFT)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_qm + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=k0 + offs < K)


def triton_quantize_rows(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None,
                         out: torch.Tensor | None = None, shift: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (less ``shift`` [K], in float32, when given) -> FP8 codes [M, K] and scales: per row
    [M] when ``scale`` is None (dynamic), else the given static scale [1]. Same contract as
    ``compiler.quant.fp8.quantize_per_token`` / ``quantize`` of ``x.float() - shift``. A float32 ``out``
    receives the saturated values before their rounding to ``dtype`` (for tests: Triton's
    interpreter does not round float32 to FP8 exactly as GPUs do)."""
    x = x.contiguous()
    M, K = x.shape
    q = torch.empty(M, K, dtype=dtype, device=x.device) if out is None else out
    dynamic = scale is None
    scale = torch.empty(M, dtype=torch.float32, device=x.device) if dynamic else scale.float().contiguous()
    block = min(triton.next_power_of_2(K), 4096)
    shift = None if shift is None else shift.float().contiguous()
    _quantize_rows_kernel[(M,)](x, x if shift is None else shift, q, scale, K, x.stride(0), q.stride(0),
                                FP8_MAX=fp8_max(dtype), MIN_SCALE=MIN_SCALE, DYNAMIC=dynamic,
                                HAS_SHIFT=shift is not None, BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return q, scale
