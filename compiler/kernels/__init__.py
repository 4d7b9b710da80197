"""Hand-written GPU kernels (OpenAI Triton) behind the quantized formats' forward.

Importing this package does not import triton (slow, and absent on CPU-only installs); the
kernel modules are imported on first use on a GPU.
"""
from __future__ import annotations

import functools
import importlib.util


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
