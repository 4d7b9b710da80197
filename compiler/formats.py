"""Imports every built-in weight format so each registers itself with ``compiler.qlinear``."""
import compiler.int4  # noqa: F401
