"""INT4 weights times int8 activations on the CPU (W4A8): qcompile's ``w4a8_linear`` (C++, AVX512-VNNI).

At a decode step's 16 rows a W4A16 kernel on this CPU is bound by float32 multiply-adds, as float's
GEMM is, so INT4 saves no time there (``docs/notes/2026-12-dense-cpu-kernel.md``). Integer dot
products (``vpdpbusd``: four int8 products per 32-bit lane and instruction) are what makes INT4
fast on a CPU; ONNX Runtime's MatMulNBits at ``accuracy_level`` 4 and llama.cpp's Q4 dot products
do the same. Each row's activations are quantized per group of the weight's input channels:

    s_a = max |a| / 127 over the group,   a_q = round(a / s_a)  (int8, ties to even; zeros past K)
    y[n] = sum_g s_w[n,g] s_a[g] (sum_k q[n,k] a_q[k] - z[n,g] sum_k a_q[k])  (+ bias)

The integer sums are exact; the float32 part differs from ``w4a8_reference`` (the same formula in
torch) by the order of its roundings, ~1e-7 relative. Against the format's W4A16 numerics it adds
the activations' int8 rounding (~6e-3 relative on a Gaussian row, like torch's bfloat16 kernel's
3e-3), so the engine runs it only when asked: ``ServingPlan.int4_compute = "w4a8"``
(``Int4Linear.use_w4a8``), the same choice as ``qcompile lower --target onnx``'s accuracy_level 4.
On SmolLM2's AWQ artifact it costs +0.05% perplexity on pydoc, +0.10% on stdlib-docs
(``python benchmarks/int4_compute_quality.py ARTIFACT``).

SmolLM2's 30 layers of INT4 projections as the engine calls them, 2 threads of the AMD EPYC,
weights cold, ms for all of them (``python benchmarks/dense_cpu.py --int4``): 1 row 3.7 (W4A16,
torch's kernel: 5.2; float32 ``dense_linear``: 9.5), 16 rows 10.5 (23.9, 19.2), 64 rows 29.2
(84.3, 65.8), 512 rows 196 (514, 503). It reads the packed weight once per call, 4 bits a weight,
at every row count: the engine keeps this one copy instead of torch's kernel's.

A group holding NaN or inf gives NaN outputs for its row (never a finite guess). A NaN-free
row's output is the same in any batch (each row is quantized on its own and summed in one order).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compiler.kernels.cpu_ext import cpu_kernels, cpu_kernels_status
from compiler.kernels.int4_cpu import ENV_SWITCH  # INT4's CPU kernels off for a process: the reference runs

KERNEL = "qcompile w4a8_linear"
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 16  # output channels per packed block: one 512-bit vector of int32 sums
INT8_MAX = 127.0


def w4a8_unavailable_reason() -> str | None:
    """Why ``w4a8_linear`` cannot run in this process, or None."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"INT4's CPU kernels are turned off ({ENV_SWITCH}=0)"
    if cpu_kernels() is None:
        return f"qcompile's C++ kernels are not loaded: {cpu_kernels_status()}"
    return None


def layer_unsupported_reason(group_size: int) -> str | None:
    """Why a layer with this group size cannot take the kernel, or None."""
    if group_size % 8:
        return f"group size {group_size} is not a multiple of 8, which the kernel's packing needs"
    return None


@dataclass(frozen=True)
class W4A8Pack:
    """An ``Int4Linear``'s weights in the kernel's layout (a derived copy: never saved)."""

    codes: torch.Tensor  # uint8 [ceil(N/16), K_pad/8, 16, 4]: channel c's k..k+3 low nibbles, k+4..k+7 high
    scales: torch.Tensor  # float32 [ceil(N/16), n_groups, 16]
    zero_scales: torch.Tensor  # float32, the same: zero point times scale
    group_size: int
    out_features: int


def pack_w4a8(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> W4A8Pack:
    """Codes uint8 [N, K_pad], scales [N, n_groups], integer zero points [N, n_groups] -> the kernel's
    operands (codes unchanged; channels past N, up to a multiple of 16, are zeros and never stored)."""
    n, k_pad = codes.shape
    n_groups, blocks = scales.shape[1], -(-n // BLOCK)
    pad = blocks * BLOCK - n
    s, z = scales.float(), zeros.float()
    if pad:
        codes, s, z = (F.pad(t, (0, 0, 0, pad)) for t in (codes, s, z))
    c = codes.reshape(blocks, BLOCK, k_pad // 8, 2, 4).permute(0, 2, 1, 3, 4)
    packed = (c[..., 0, :] | (c[..., 1, :] << 4)).contiguous()

    def per_block(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(blocks, BLOCK, n_groups).transpose(1, 2).contiguous()

    return W4A8Pack(packed, per_block(s), per_block(z * s), group_size, n)


def w4a8_matmul(x: torch.Tensor, pack: W4A8Pack, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (float32, bfloat16 or float16; K <= K_pad) -> [..., N] in x's dtype, plus ``bias``."""
    y = cpu_kernels().w4a8_linear(x.float(), pack.codes, pack.scales, pack.zero_scales, pack.group_size, pack.out_features,
                           None if bias is None else bias.float())
    return y if y.dtype is x.dtype else y.to(x.dtype)


def quantize_activations(x: torch.Tensor, group_size: int, padded_in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation codes in torch: x [M, K] -> (codes float32 [M, n_groups, g], scales
    [M, n_groups, 1]), zero-padded to ``padded_in_features``; the same codes bit for bit."""
    a = F.pad(x.float(), (0, padded_in_features - x.shape[-1])).reshape(x.shape[0], -1, group_size)
    amax = a.abs().amax(-1, keepdim=True)
    inv = INT8_MAX / amax
    q = torch.where(amax > 0, torch.round(a * inv), torch.zeros_like(a))
    return q, amax / INT8_MAX


def w4a8_reference(x: torch.Tensor, weight: torch.Tensor, group_size: int, padded_in_features: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel computes, in float64: the activations' codes times their scales, times the
    dequantized weight [N, K] (``Int4Linear.dequantized_weight()``). The tests' reference."""
    q, s = quantize_activations(x, group_size, padded_in_features)
    a = (q.double() * s.double()).reshape(x.shape[0], -1)[:, : x.shape[-1]]
    return F.linear(a, weight.double(), None if bias is None else bias.double())
