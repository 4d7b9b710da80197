"""The engine on CUDA (``pytest -m gpu``; skipped with the reason elsewhere): float, INT4 (the W4A16
kernels) and FP8 weights with an FP8 KV cache (the FP8 GEMM, the paged-decode kernel on FP8 blocks).

Two checks per artifact: the model on the GPU against the same model on the CPU (logits, within
the kernels' bounds), and the engine's greedy tokens on the GPU against the model's own reference
generation on the GPU (the contiguous cache), which the paged cache must reproduce exactly.
"""
from __future__ import annotations

import pytest
import torch
from numerics import relative_error

import passes  # noqa: F401  (registers the fp8 pass)
from compiler.formats.int4 import Int4Linear
from compiler.formats.qlinear import linear_modules
from compiler.io.artifact import load_artifact
from compiler.io.load import load_checkpoint
from compiler.pipeline import PipelineConfig
from compiler.pipeline.compile import compile_loaded

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 9, 14], [7, 8, 9, 10, 11, 12, 13, 40, 41]]
# Logits on the GPU against the CPU: float32 matmuls (no TF32 in torch by default) for float; the fused
# W4A16 kernel's TF32 dot for INT4; Hopper's FP8 accumulation for FP8 (several layers deep).
LOGIT_BOUNDS = {"float": 1e-4, "int4": 1e-2, "fp8": 5e-2}


@pytest.fixture
def artifact(tiny_checkpoint_with_tokenizer, tmp_path):
    """Factory: the tiny model as a "float", "int4" (RTN, g32) or "fp8" (W8A8 + FP8 KV) artifact."""
    src, _ = tiny_checkpoint_with_tokenizer("llama")

    def make(kind: str):
        loaded = load_checkpoint(src)
        passes_ = []
        if kind == "int4":
            for name, linear in linear_modules(loaded.model).items():
                if name != "lm_head":
                    loaded.model.set_submodule(name, Int4Linear.from_float(linear, 32))
        if kind == "fp8":
            passes_ = [{"name": "fp8", "kv_cache_dtype": "float8_e4m3fn", "max_layer_error": 10.0}]
        config = PipelineConfig.from_dict({"calibration": {"samples": 4, "seq_len": 64}, "passes": passes_})
        return compile_loaded(loaded, config, tmp_path / kind).path

    return make


@pytest.mark.parametrize("kind", ["float", "int4", "fp8"])
@torch.no_grad()
def test_engine_on_cuda(artifact, kind):
    from serving.engine import Engine

    path = artifact(kind)
    cpu = load_artifact(path).model
    ids = torch.randint(3, cpu.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    gpu = load_artifact(path).model.to("cuda")
    assert relative_error(gpu(ids.to("cuda")), cpu(ids)) < LOGIT_BOUNDS[kind]
    want = [gpu.generate(torch.tensor([p], device="cuda"), 8)[0, len(p):].tolist() for p in PROMPTS]
    engine = Engine.from_artifact(path, "cuda", block_size=4, num_blocks=64)
    assert engine.cache.decode_kernel == "triton" and engine.cache.k[0].is_cuda
    if kind == "fp8":
        assert engine.cache.k[0].dtype == torch.float8_e4m3fn
    got = [engine.generate(prompt_token_ids=p, max_tokens=8, ignore_eos=True).token_ids for p in PROMPTS]
    assert got == want
