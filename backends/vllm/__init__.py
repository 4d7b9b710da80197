"""vLLM target: a compressed-tensors checkpoint (``export.py``) and the ``vllm serve`` process (``runtime.py``).

Registers the ``vllm`` target, whose constraints (``schemes.py``) the pipeline checks before any
pass runs and ``qcompile lower`` checks for an existing artifact, and its lowering:

    qcompile lower ARTIFACT --target vllm -o DIR     # DIR: a Hugging Face-style checkpoint
    qcompile serve DIR --engine vllm                 # vllm serve DIR on 127.0.0.1 (OpenAI API)
"""
from __future__ import annotations

from backends.vllm.export import VllmLowerOptions, export_vllm
from backends.vllm.schemes import check_module, check_plan
from compiler.deploy.targets import Target, register_target

register_target(Target("vllm", "vLLM: a compressed-tensors checkpoint (INT4 pack-quantized, INT8 int-quantized, FP8 "
                               "float-quantized)",
                       check_module, export_vllm, VllmLowerOptions, check_plan))
