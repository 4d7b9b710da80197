"""Imports every built-in weight format so each registers itself with ``compiler.qlinear``."""
