"""The relative error every kernel and model check in the tests reports, the FP8 GEMM's bounds on it, and a
seed that is the same in every process."""
from __future__ import annotations

import zlib

import torch

# The FP8 GEMM against the float32 dequantize reference, per device: the interpreter and torch on
# the CPU sum exact FP8 products in float32; Hopper's FP8 tensor cores accumulate with fewer bits
# (the H200 run of benchmarks/gpu_kernels.py: 4.1e-4..1.0e-3 for K = 576..1536, up to 4.4e-3 at
# K = 14336, docs/data/gpu_kernels_h200.json; the tests' shapes have K <= 192).
FP8_GEMM_BOUNDS = {"cpu": 1e-5, "cuda": 5e-3}


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 on the CPU; NaN or inf anywhere gives inf, which never passes."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if not (torch.isfinite(got).all() and torch.isfinite(ref).all()):
        return float("inf")
    return float((got - ref).norm() / ref.norm())


def stable_seed(*parts) -> int:
    """The same seed in every process (``hash`` of a tuple changes per process with PYTHONHASHSEED)."""
    return zlib.crc32(repr(parts).encode()) % 10_000
