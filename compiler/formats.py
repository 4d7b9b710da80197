"""Imports every built-in weight format so each registers itself with ``compiler.qlinear``."""

import compiler.fp8  # noqa: F401,E402  (fp8: FP8 weights, optional FP8 activations)
