"""GGUF target: one file llama.cpp runs (``export.py``), and llama.cpp's own build (``llama_cpp.py``).

    qcompile lower ARTIFACT --target gguf -o MODEL.gguf
    qcompile serve MODEL.gguf --engine llama.cpp       # llama-server on 127.0.0.1 (OpenAI API)
"""
from __future__ import annotations

from backends.gguf.export import GgufLowerOptions, check_module, check_plan, export_gguf
from compiler.deploy.targets import Target, register_target

register_target(Target("gguf", "llama.cpp: one GGUF file (Q4_0/Q4_1 from INT4, the awq pass's gguf: block types, float)",
                       check_module, export_gguf, GgufLowerOptions, check_plan))
