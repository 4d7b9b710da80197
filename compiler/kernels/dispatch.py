"""The one place that chooses which kernel a linear layer's forward runs, and says why.

Each layer format asks its function here with the layer and the call's input, and runs the
``Kernel`` it gets; nothing else decides:

    int4_kernel(layer, x)       Int4Linear (compiler/formats/int4.py); resolve_int4_compute: the serving plan's
                                int4_compute ("auto": W4A8 on a CPU that runs it)
    fp8_kernel(layer, x)        Fp8Linear (compiler/formats/fp8.py)
    float_kernel(x, weight, packed)   a float32 linear on a packed copy (compiler/kernels/dense_cpu.py)

A ``Kernel`` names what runs; the fast path of a format carries no reason, every other path says why
the fast one was not taken (the device, the dtype, autograd, a group size, the CPU, a switch). A
qcompile C++ kernel (``qcompile=True``) runs at the process's ISA level (``cpu_isa``: the best the
CPU runs, or ``QCOMPILE_CPU_ISA``'s cap), which ``describe()`` names. The serving engine reports a
model's choices as a decode step and a prefill would make them (``serving/engine_setup.py``).

Where each kernel lives: ``cpu_ext.py`` (qcompile's C++ kernels), ``int4_cpu.py`` (torch's INT4
kernel and the INT4 prefill), ``w4a8_cpu.py`` (W4A8), ``fp8_gemm.py`` (FP8's per-call paths),
``dense_cpu.py`` (packed float32), ``w4a16.py`` / ``fp8.py`` (OpenAI Triton, CUDA).

Switches, each for a process, to compare a path with the one below it:

    QCOMPILE_CPU_KERNELS=0           no qcompile C++ kernels: the torch code runs (cpu_ext.py)
    QCOMPILE_CPU_ISA=avx2            their ISA level capped (cpu_isa.py)
    QCOMPILE_INT4_CPU_KERNEL=0       INT4 layers on the dequantize reference (int4_cpu.py)
    QCOMPILE_FP8_CPU_CODES=0         FP8 layers on a float32 copy of their weight, not their codes
    QCOMPILE_FP8_CPU_FLOAT_WEIGHT=0  nor on a float32 copy: FP8's per-call path (memory over speed)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from compiler.kernels import triton_available
from compiler.kernels.cpu_ext import cpu_isa_in_use, cpu_kernels, cpu_kernels_status
from compiler.kernels.cpu_isa import cpuinfo_field
from compiler.kernels.int4_cpu import ACTIVATION_DTYPES, REFERENCE_MIN_TOKENS, activation_unsupported_reason, kernel_enabled
from compiler.kernels.int4_cpu import ENV_SWITCH as INT4_SWITCH
from compiler.kernels.w4a8_cpu import w4a8_unavailable_reason

CODES_SWITCH = "QCOMPILE_FP8_CPU_CODES"
FLOAT_WEIGHT_SWITCH = "QCOMPILE_FP8_CPU_FLOAT_WEIGHT"
# From this many tokens on, a CUDA INT4 forward dequantizes W (a Triton kernel) and calls cuBLAS instead
# of the fused W4A16 kernel, which is faster up to 128 tokens and slower at 2048 (the W4A16 table of
# docs/notes/2026-11-h200-gpu-kernels.md; the crossover between the two was not measured).
DEQUANT_MIN_TOKENS = 256


@dataclass(frozen=True)
class Kernel:
    """What a forward runs; ``why``: why not the format's fast path (None when it is that path)."""

    name: str
    qcompile: bool = False  # one of qcompile's C++ kernels, at the process's ISA level
    why: str | None = None
    recorded: bool = False  # an input the layer's kernels do not take: the layer records why (``fallbacks``)

    def because(self, why: str) -> "Kernel":
        return replace(self, why=why)

    def describe(self) -> str:
        isa = f" [{cpu_isa_in_use()}]" if self.qcompile else ""
        return self.name + isa + (f" ({self.why})" if self.why else "")


REFERENCE = Kernel("reference")
AUTOGRAD = REFERENCE.because("autograd: the kernels have no backward")
REFERENCE_ONLY = REFERENCE.because("inside reference_only()")

INT4_TRITON = Kernel("triton w4a16_matmul")
INT4_CUDA_MANY_TOKENS = Kernel("triton w4_dequantize + F.linear")
W4A8 = Kernel("w4a8_linear", qcompile=True)
INT4_TORCH = Kernel("aten._weight_int4pack_mm_for_cpu")
INT4_PREFILL = Kernel("int4_dense_linear", qcompile=True)


def int4_kernel(layer, x: torch.Tensor) -> Kernel:
    """What ``Int4Linear.forward(x)`` runs. The fast paths: on CUDA the Triton W4A16 kernel; on the
    CPU ``w4a8_linear`` where the layer was put on W4A8 (``Int4Linear.use_w4a8``), else torch's INT4
    kernel below ``REFERENCE_MIN_TOKENS`` tokens (``layer.kernel_reason``: why a layer cannot take
    it) and ``int4_dense_linear`` from there on float32."""
    if x.is_cuda and triton_available():
        return INT4_TRITON if x.numel() < DEQUANT_MIN_TOKENS * layer.in_features else INT4_CUDA_MANY_TOKENS
    if not kernel_enabled():
        return REFERENCE_ONLY
    if x.requires_grad and torch.is_grad_enabled():
        return AUTOGRAD
    if not x.is_cpu or x.dtype not in ACTIVATION_DTYPES:
        return replace(REFERENCE, why=activation_unsupported_reason(x), recorded=True)
    if layer.runs_w4a8:
        return W4A8
    if layer.kernel_reason is None and x.numel() < REFERENCE_MIN_TOKENS * layer.in_features:
        return INT4_TORCH
    if _takes_int4_prefill(layer, x):
        return INT4_PREFILL
    return REFERENCE.because(layer.kernel_reason or "many tokens outside float32 or inside autograd, which "
                                                   "int4_dense_linear does not take")


def _takes_int4_prefill(layer, x: torch.Tensor) -> bool:
    """float32 activations, scales and bias, outside autograd, a group of whole bytes, the kernels loaded."""
    return (x.dtype is torch.float32 and layer.scales.dtype is torch.float32
            and (layer.bias is None or layer.bias.dtype is torch.float32) and layer.group_size % 8 == 0
            and not torch.is_grad_enabled() and int4_prefill_enabled())


def int4_prefill_enabled() -> bool:
    """Whether ``int4_dense_linear`` runs here: the C++ kernels loaded, INT4's not turned off."""
    return os.environ.get(INT4_SWITCH, "1") != "0" and cpu_kernels() is not None


def resolve_int4_compute(compute: str, device: torch.device) -> tuple[str, str | None]:
    """The plan's ``int4_compute`` as the engine runs it, and why when "auto" did not give W4A8:
    "auto" is W4A8 on a CPU whose kernels run it (as llama.cpp, ONNX Runtime's MatMulNBits at its
    default accuracy_level 4 and OpenVINO compute by default), W4A16 elsewhere."""
    if compute != "auto":
        return compute, None
    if device.type != "cpu":
        return "w4a16", f"auto: W4A8 is a CPU kernel, this engine runs on {device.type}"
    if why := w4a8_unavailable_reason():
        return "w4a16", f"auto: W4A8 cannot run here ({why})"
    return "w4a8", None


FP8_CODES = Kernel("fp8_linear_codes", qcompile=True)
FP8_FLOAT_COPY_CALL = Kernel("fp8_linear on the float32 copy", qcompile=True)
FP8_FLOAT_COPY = Kernel("the float32 copy's matmul")
FP8_GEMM = Kernel("fp8_gemm")  # _scaled_mm on the CPU, Triton on CUDA, else the dequantize reference
FP8_WEIGHT_ONLY = Kernel("the dequantized weight's matmul")


def fp8_codes_gemm_enabled() -> bool:
    """Whether ``fp8_linear_codes`` runs here: the kernels loaded, and not turned off
    (``QCOMPILE_FP8_CPU_CODES=0``, to compare with the float copy)."""
    return cpu_kernels() is not None and os.environ.get(CODES_SWITCH, "1") != "0"


def float_weight_enabled() -> bool:
    """Whether ``Fp8Linear`` on the CPU may keep a float32 copy of its weight (unless turned off by
    ``QCOMPILE_FP8_CPU_FLOAT_WEIGHT=0``)."""
    return os.environ.get(FLOAT_WEIGHT_SWITCH, "1") != "0"


def fp8_kernel(layer, x: torch.Tensor) -> Kernel:
    """What ``Fp8Linear.forward(x)`` runs. The fast path: a float32 model's CPU forward outside
    autograd in one C++ call, on the codes themselves (``fp8_linear_codes``)."""
    if why := _no_one_call(layer, x):
        if x.is_cpu and float_weight_enabled():
            return FP8_FLOAT_COPY.because(why)
        return (FP8_GEMM if layer.format.quantizes_activations else FP8_WEIGHT_ONLY).because(why)
    if layer.weight.is_cpu and fp8_codes_gemm_enabled():
        return FP8_CODES
    if float_weight_enabled():
        return FP8_FLOAT_COPY_CALL.because("QCOMPILE_FP8_CPU_CODES=0")
    return FP8_GEMM.because("QCOMPILE_FP8_CPU_CODES=0 and QCOMPILE_FP8_CPU_FLOAT_WEIGHT=0")


def _no_one_call(layer, x: torch.Tensor) -> str | None:
    """Why ``fp8_kernel``'s one-call CPU paths cannot take this call, or None."""
    fmt = layer.format
    if not x.is_cpu:
        return f"activations on {x.device.type}"
    if x.dtype is not torch.float32 or (layer.bias is not None and layer.bias.dtype is not torch.float32):
        return f"{x.dtype} activations: the C++ kernels take float32"
    if not fmt.quantizes_activations:
        return "weight-only FP8"
    if fmt.activation_group_size:
        return "per-group activation scales"
    if layer.outlier_index is not None:
        return "outlier channels"
    if torch.is_grad_enabled():
        return AUTOGRAD.why
    if cpu_kernels() is None:
        return f"qcompile's C++ kernels {cpu_kernels_status()}"
    return None


FLOAT_PACKED = Kernel("dense_linear", qcompile=True)
FLOAT_ONEDNN = Kernel("oneDNN _linear_pointwise")
FLOAT_MKL = Kernel("F.linear")
FLOAT_NOT_PACKED = FLOAT_MKL.because("no packed copy")
FLOAT_AUTOGRAD = FLOAT_MKL.because(AUTOGRAD.why)
FLOAT_FEW_ROWS = FLOAT_MKL.because("fewer rows than a packed copy pays for (packed_from_rows())")


def cpu_vendor() -> str:
    """The CPU's vendor id (``GenuineIntel``, ``AuthenticAMD``, ...), "" where /proc/cpuinfo does not say."""
    return cpuinfo_field("vendor_id") or ""


# oneDNN's crossover with MKL (benchmarks/dense_cpu.py): on a Xeon MKL's gemv wins below 4 rows (at 3
# the two are level); elsewhere oneDNN wins at every size. qcompile's dense_linear wins from one row.
ONEDNN_FROM_ROWS = 4 if cpu_vendor() == "GenuineIntel" else 1


def packed_from_rows() -> int:
    """The rows from which a packed weight is faster than ``F.linear``'s on the weight as stored."""
    return 1 if cpu_kernels() is not None else ONEDNN_FROM_ROWS


def float_kernel(x: torch.Tensor, weight: torch.Tensor, packed) -> Kernel:
    """What ``dense_cpu.dense`` runs: the packed copy from ``packed_from_rows()`` rows on outside
    autograd (qcompile's ``dense_linear`` where the C++ kernels are loaded, else oneDNN), else
    ``F.linear`` on the weight as stored (MKL)."""
    if packed is None:
        return FLOAT_NOT_PACKED
    if torch.is_grad_enabled():
        return FLOAT_AUTOGRAD
    if x.numel() < packed_from_rows() * weight.shape[1]:
        return FLOAT_FEW_ROWS
    return FLOAT_PACKED if cpu_kernels() is not None else FLOAT_ONEDNN
