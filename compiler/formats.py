"""Imports every built-in weight format so each registers itself with ``compiler.qlinear``."""
import compiler.fp8  # noqa: F401  (FP8 weights, optional FP8 activations)
import compiler.int4  # noqa: F401  (INT4 W4A16 in MatMulNBits layout)
