"""Triton Inference Server target: lowering (``lower.py``; a vLLM-backend repository: ``vllm_repo.py``),
the server (``runtime.py``). The served model is ``serving/triton_backend.py``, which the
repository's ``1/model.py`` imports.

Registers the ``triton`` target: the model runs the qcompile engine inside Triton's Python
backend, so it runs the weight formats the engine runs (``SUPPORTED``).
"""
from __future__ import annotations

from pathlib import Path

from backends.triton.lower import LowerOptions
from compiler.deploy.targets import LowerResult, Target, register_target
from compiler.quant.int4 import GROUP_SIZES

# Weight format -> allowed group sizes (None: the format has no groups).
SUPPORTED: dict[str, tuple[int, ...] | None] = {
    "int4": GROUP_SIZES,  # AWQ's packed INT4 (compiler/formats/int4.py), every group size its kernels take
    "fp8": None,  # E4M3/E5M2 weights, with or without FP8 activations (compiler/formats/fp8.py)
    "int8": None,  # INT8 per-channel weights, W8A8 or W8A16 (compiler/formats/int8.py)
}


def check_module(module: str, fmt: dict) -> str | None:
    """None when the Triton model can run ``module`` stored as ``fmt``, else why not."""
    name = fmt.get("format")
    if name not in SUPPORTED:
        return f"weight format {name!r} (Triton runs float, {', '.join(SUPPORTED)})"
    groups = SUPPORTED[name]
    if groups is not None and fmt.get("group_size") not in groups:
        return f"{name} group size {fmt.get('group_size')} (Triton's INT4 kernels take {', '.join(map(str, groups))})"
    return None


def _lower(artifact: Path, out: Path, opts: LowerOptions, force: bool) -> LowerResult:
    from backends.triton.lower import lower_triton

    return LowerResult(lower_triton(artifact, out, opts, force))


register_target(Target("triton", "Triton Inference Server, Python backend running the qcompile engine (CPU or CUDA)",
                       check_module, _lower, LowerOptions))
