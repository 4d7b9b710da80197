"""GGUF target: one file llama.cpp runs (``export.py``), and llama.cpp's own build (``llama_cpp.py``).

    qcompile lower ARTIFACT --target gguf -o MODEL.gguf
    qcompile serve MODEL.gguf --engine llama.cpp       # llama-server on 127.0.0.1 (OpenAI API)
"""
from __future__ import annotations

from pathlib import Path

from backends.gguf.export import GgufLowerOptions, check_module, check_plan, export_gguf
from compiler.deploy.lowering import register_lowering
from compiler.deploy.targets import TargetSpec, register_target


def _lower(artifact: Path, out: Path, opts: GgufLowerOptions, force: bool) -> Path:
    return export_gguf(artifact, out, opts, force)


register_target(TargetSpec("gguf", "llama.cpp: one GGUF file (Q4_0/Q4_1 from INT4, the awq pass's gguf: block types, float)",
                           check_module, check_plan))
register_lowering("gguf", _lower, GgufLowerOptions)
