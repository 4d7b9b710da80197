"""Compiler passes; each registers itself with ``compiler.pipeline.register_pass`` on import."""
import passes.distill  # noqa: F401
