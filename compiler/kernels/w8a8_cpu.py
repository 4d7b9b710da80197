"""INT8 weights times int8 activations on the CPU (W8A8): qcompile's ``w8a8_linear`` (C++, every ISA level).

What it computes is ``compiler/quant/int8.py``'s numerics, bit for bit: the weight's symmetric
per-channel codes q_w [N, K] (-127..127) and scales s_w [N]; each call quantizes x's rows to int8
itself, in one of three ways,

    dynamic symmetric   (default)              quantize_per_token(x, symmetric=True)
    dynamic asymmetric  (symmetric=False)      quantize_per_token(x, symmetric=False)
    static per tensor   (input_scale given)    quantize_activations(x, input_scale, input_zero_point)

then y = float32(q_a . q_w - zp sum_k q_w) * (s_a s_w) + b as ``int8_gemm`` computes it: the
integer part exact in int32, the float32 part the same roundings in the same order, so the output
equals ``int8_gemm(*quantize_per_token(x, symmetric), q_w, s_w, bias)`` (``torch.equal``) at every
ISA level (``csrc/w8a8.cpp``: vpdpbusd on AVX512-VNNI and AVX-VNNI, exact int16 ``vpmaddwd`` on
AVX-512 and AVX2). A row holding NaN or inf gives NaN outputs for that row, in the static mode too
(where ``quantize_activations`` alone would clamp inf to 127 and cast NaN to an arbitrary code).
A NaN-free row's output is the same in any batch.

SmolLM2-135M's 30 layers of projections (q/k/v fused 576->960, o 576->576, gate/up fused 576->3072,
down 1536->576), weights cold, 2 threads of the AMD EPYC (Zen 4: AVX-512, VNNI, BF16; no AVX-VNNI),
ms for all of them, symmetric per-token activations (``python benchmarks/dense_cpu.py --int8 --rows
1,16,64,512 --isa avx512_bf16,avx2``, 2026-12-07, no other process running):

    rows                                   1      16     64     512
    avx512_bf16  float32 dense_linear     18.1   25.9   76.5   537
                 w8a8_linear (vpdpbusd)    6.6   10.6   27.6   172
                 torch._int_mm + torch     20.0   38.5   63.3   616
    avx2         float32 dense_linear     11.6   32.9   81.1   602
                 w8a8_linear (vpmaddwd)    4.8   18.7   53.2   571

(torch's column: quantize_per_token, ``_int_mm`` on the weight transposed once, the scaling; the
runs vary by ~10-20% from one to the next on this shared host.) At one row it reads a quarter of
float32's bytes (106 MB against 425 MB); at 16 and more rows AVX512-VNNI's vpdpbusd does 4x float32's
multiply-adds per instruction. The AVX2 way (no VNNI) does two int16 products per lane and
instruction, so from 64 rows it gains little on float32's FMA.

The packed weight (``pack_w8a8``) is a derived copy, never saved: the codes in blocks of 16 output
channels x 4 consecutive k (1 byte a weight) and each channel's sum of codes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compiler.kernels.cpu_ext import cpu_kernels, cpu_kernels_status

KERNEL = "qcompile w8a8_linear"
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 16  # output channels per packed block: one 512-bit vector of int32 sums
K_STEP = 4  # consecutive input channels per 32-bit lane (vpdpbusd's four products)


def w8a8_unavailable_reason() -> str | None:
    """Why ``w8a8_linear`` cannot run in this process, or None."""
    if cpu_kernels() is None:
        return f"qcompile's C++ kernels are not loaded: {cpu_kernels_status()}"
    return None


@dataclass(frozen=True)
class W8A8Pack:
    """An int8 weight in the kernel's layout (a derived copy: never saved)."""

    codes: torch.Tensor  # int8 [ceil(N/16), ceil(K/4), 16, 4]: per block and 4 k, each channel's 4 codes (zeros past N, K)
    sums: torch.Tensor  # int32 [ceil(N/16) * 16]: each channel's sum of codes (0 past N)
    out_features: int


def pack_w8a8(codes: torch.Tensor) -> W8A8Pack:
    """Weight codes int8 [N, K] (symmetric, -127..127) -> the kernel's operands."""
    if codes.dtype is not torch.int8 or codes.dim() != 2:
        raise ValueError(f"pack_w8a8 takes int8 codes [N, K], not {codes.dtype} {tuple(codes.shape)}")
    n, k = codes.shape
    blocks, steps = -(-n // BLOCK), -(-k // K_STEP)
    padded = F.pad(codes, (0, steps * K_STEP - k, 0, blocks * BLOCK - n))
    packed = padded.reshape(blocks, BLOCK, steps, K_STEP).permute(0, 2, 1, 3).contiguous()
    return W8A8Pack(packed, padded.sum(dim=1, dtype=torch.int32).contiguous(), n)


def w8a8_matmul(x: torch.Tensor, pack: W8A8Pack, weight_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                input_scale: torch.Tensor | None = None, input_zero_point: torch.Tensor | None = None,
                symmetric: bool = True) -> torch.Tensor:
    """x [..., K] (float32, bfloat16 or float16) -> [..., N] in x's dtype: the activations quantized
    per token (``symmetric`` or not) or, given ``input_scale`` [1] (and ``input_zero_point`` [1], int32;
    None: symmetric), per tensor; times the weight, scaled by ``weight_scale`` [N], plus ``bias``."""
    def f32(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.float().reshape(-1).contiguous()

    zero_point = None if input_zero_point is None else input_zero_point.to(torch.int32).reshape(-1).contiguous()
    y = cpu_kernels().w8a8_linear(x.float(), pack.codes, pack.sums, f32(weight_scale), pack.out_features, f32(bias),
                                  f32(input_scale), zero_point, symmetric)
    return y if y.dtype is x.dtype else y.to(x.dtype)
