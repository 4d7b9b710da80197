"""INT4 weight-only matmul on the CPU through torch's packed-int4 kernel.

torch ships ``aten._weight_int4pack_mm_for_cpu`` (with ``aten._convert_weight_to_int4pack_for_cpu``
to pack its weight). Its contract, read from ``aten/src/ATen/native/cpu/int4mm_kernel.cpp`` and
checked by probing torch 2.13:

    A                 [M, K] float32 | bfloat16 | float16, contiguous; K % group_size == 0
    B                 uint8 [N, K / 2] in the kernel's own blocked layout (CPU-capability
                      specific, so it is built on the machine that runs it, never stored),
                      from int32 codes [N, K] in [0, 15]; N % 16 == 0
    group_size        32, 64, 128 or 256
    scales_and_zeros  [K / group_size, N, 2], A's dtype: [..., 0] the scale s, [..., 1] a float
                      zero z'
    w[n, k] = (q[n, k] - 8) * s + z'   ->   C = A @ w.T, [M, N] in A's dtype

Our format's ``w = (q - z) * s`` with integer zero point z (``compiler/quant/int4.py``) maps onto
it with the codes unchanged: ``z' = (8 - z) * s`` (symmetric layers, z = 8, give z' = 0).

On x86 only the bfloat16 variant is vectorized (AVX2 / AVX-512: dequantize in float32 registers,
float32 accumulation, bfloat16 out); float32 and float16 take a scalar loop ~40x slower than a
float32 matmul. So every activation dtype runs the kernel in bfloat16 — W4A16, as the format's
name says — and is cast back: the kernel's result differs from the float32 dequantize reference
by bfloat16 rounding of the activations, the scales, z' and the output (~3e-3 relative, measured
in tests/compiler/kernels/test_int4_cpu.py), never by the codes.

From ``REFERENCE_MIN_TOKENS`` tokens on (a prefill) the kernel is slower than a float32 GEMM, so a
float32 forward runs qcompile's ``int4_dense_linear`` instead (C++, every ISA level,
``dispatch.int4_prefill_enabled()``): the reference's float32 weights, dequantized three blocks of 16 channels
at a time into a panel that stays in cache, times the activations by ``dense_linear``'s tiles —
within ~1e-7 of the reference, without ever building the whole float weight. Elsewhere those
tokens run the reference itself (dequantize, then ``F.linear``).

Exporters are checked against the reference, not against this rounding: ``reference_only()``
turns the kernel off for a block of code, and ``QCOMPILE_INT4_CPU_KERNEL=0`` for a process (a
recorded reason, like any other layer that cannot use the kernel).
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compiler.kernels.cpu_ext import cpu_kernels
from compiler.quant.int4 import SYMMETRIC_ZERO

KERNEL = "aten._weight_int4pack_mm_for_cpu"
KERNEL_GROUP_SIZES = (32, 64, 128, 256)
N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu packs rows in blocks of 16
COMPUTE_DTYPE = torch.bfloat16
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
VECTORIZED_CAPABILITIES = ("AVX2", "AVX512")  # torch's x86 builds of the bfloat16 tinygemm
# From this many tokens on, dequantize-then-matmul beats the kernel, which is a register-blocked
# FMA loop (4 rows at a time) rather than a GEMM: 2x slower than a float32 matmul at 128 tokens,
# and slower than dequantize + matmul at 512 (measured with benchmarks/int4_cpu.py; not yet in the benchmarks doc).
REFERENCE_MIN_TOKENS = 256
ENV_SWITCH = "QCOMPILE_INT4_CPU_KERNEL"
_override = {"reference_only": False}


@functools.cache
def kernel_unavailable_reason() -> str | None:
    """Why this torch/CPU cannot run the kernel at all, or None."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"turned off by {ENV_SWITCH}=0"
    ops = torch.ops.aten
    if not (hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")):
        return f"this torch ({torch.__version__}) has no {KERNEL}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in VECTORIZED_CAPABILITIES:
        return f"CPU capability {capability}: torch's int4 kernel is vectorized only for {'/'.join(VECTORIZED_CAPABILITIES)}"
    return None


def layer_unsupported_reason(out_features: int, padded_in_features: int, group_size: int) -> str | None:
    """Why a layer of this shape cannot use the kernel (it then runs the dequantize reference), or None.

    ``padded_in_features`` is the packed K (a multiple of the group); a layer whose in_features is
    smaller (group_size_policy "pad") still runs the kernel, on zero-padded activations.
    """
    unavailable = kernel_unavailable_reason()
    if unavailable:
        return unavailable
    if group_size not in KERNEL_GROUP_SIZES:
        return f"group size {group_size}: the kernel takes {', '.join(map(str, KERNEL_GROUP_SIZES))}"
    if out_features % N_MULTIPLE:
        return f"out_features {out_features} is not a multiple of {N_MULTIPLE}, which the kernel's packing needs"
    if padded_in_features % group_size:  # our packing never makes this; kept for hand-built modules
        return f"packed in_features {padded_in_features} is not a multiple of the group size {group_size}"
    return None


@contextlib.contextmanager
def reference_only():
    """Inside this block every ``Int4Linear`` runs the dequantize reference (e.g. to check an
    exporter against the exact numerics of the format rather than against the kernel's rounding)."""
    before, _override["reference_only"] = _override["reference_only"], True
    try:
        yield
    finally:
        _override["reference_only"] = before


def int4_dense_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x float32 [..., K] times an ``Int4Linear``'s buffers (qweight [N, n_blocks, g/2], float32
    scales [N, n_blocks], zero points [N, n_blocks], unpacked) through ``int4_dense_linear``."""
    return cpu_kernels().int4_dense_linear(x, qweight.reshape(qweight.shape[0], -1), scales, zeros.float(),
                                            group_size, bias)


def kernel_enabled() -> bool:
    """False inside ``reference_only()``."""
    return not _override["reference_only"]


def activation_unsupported_reason(x: torch.Tensor) -> str | None:
    """Why this call's activations cannot go through the kernel, or None."""
    if x.device.type != "cpu":
        return f"activations on {x.device.type}, the kernel is the CPU's"
    if x.dtype not in ACTIVATION_DTYPES:
        return f"{x.dtype} activations; the kernel takes {', '.join(str(d) for d in ACTIVATION_DTYPES)}"
    return None


@dataclass(frozen=True)
class Int4CpuPack:
    """An ``Int4Linear``'s weights repacked for the kernel (a derived copy: never saved)."""

    weight: torch.Tensor  # uint8 [N, K_padded / 2], the kernel's layout for this CPU
    scales_and_zeros: torch.Tensor  # COMPUTE_DTYPE [n_blocks, N, 2]
    group_size: int
    padded_in_features: int


def pack_for_cpu(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> Int4CpuPack:
    """Codes uint8 [N, K_padded], scales [N, n_blocks], integer zero points [N, n_blocks] -> the
    kernel's operands, with z' = (8 - z) * s (computed in float32, then rounded once)."""
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    s = scales.float()
    z_float = (SYMMETRIC_ZERO - zeros.float()) * s
    scales_and_zeros = torch.stack((s, z_float), dim=-1).transpose(0, 1).to(COMPUTE_DTYPE).contiguous()
    return Int4CpuPack(weight, scales_and_zeros, group_size, codes.shape[1])


def int4_cpu_matmul(x: torch.Tensor, pack: Int4CpuPack, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (K <= K_padded; the rest is zero-padded) -> [..., N] in x's dtype, plus ``bias``."""
    ops = cpu_kernels()
    if ops is not None:  # the same ops below in one C++ call: at a few tokens their dispatch is the cost
        return ops.int4_linear(x, pack.weight, pack.group_size, pack.scales_and_zeros, pack.padded_in_features, bias)
    shape = x.shape
    k = shape[-1]
    a = x.reshape(-1, k).to(COMPUTE_DTYPE, memory_format=torch.contiguous_format)
    if k != pack.padded_in_features:  # padded codes dequantize to 0, so zero activations add nothing
        a = F.pad(a, (0, pack.padded_in_features - k))
    y = _int4pack_mm(a, pack.weight, pack.group_size, pack.scales_and_zeros).to(x.dtype)
    if bias is not None:
        y += bias.to(x.dtype)
    return y.view(shape[:-1] + y.shape[-1:])


def _int4pack_mm(a, weight, group_size, scales_and_zeros):
    return _INT4PACK_MM(a, weight, group_size, scales_and_zeros)


# Looked up once: each ``torch.ops.aten.NAME`` is a Python attribute lookup costing µs per decode-step call.
_INT4PACK_MM = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
_INT4PACK_MM = _INT4PACK_MM.default if _INT4PACK_MM is not None else None
