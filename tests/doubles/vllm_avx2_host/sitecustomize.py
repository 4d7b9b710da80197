"""TEST DOUBLE: the CPU-capability checks of torch that vLLM reads answer as on an AVX2-only x86
host (no AVX-512, no AVX512-BF16, no AMX), in the processes of vLLM's environment started through
``python`` beside this file.

vLLM decides with these checks which build of its C++ ops to load (``_C_AVX2`` here;
``platforms/cpu.py``, ``import_kernels``) and whether its CPU attention takes an FP8 KV cache
(``v1/attention/backends/cpu_attn.py``, ``_get_attn_isa``). The CPU still runs what it runs: only
vLLM's choices change, so that an AVX-512 host tests the branches an AVX2 host takes.
"""
import torch

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
torch.cpu._is_amx_tile_supported = lambda: False
torch.cpu._is_amx_fp16_supported = lambda: False
