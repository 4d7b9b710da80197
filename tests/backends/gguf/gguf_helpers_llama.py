"""Tiny checkpoints of the four architectures the GGUF target writes, compiled with the awq pass,
and the engine reference llama.cpp is compared with: the artifact's model with each quantized
layer's input rounded to int8 per block as llama.cpp's vec-dot kernels round it (Q8_0 per 32 for
Q4_0/Q4_1/Q5_0/Q8_0 weights, Q8_K per 256 for the K-quants): the like-for-like W4A8 reference."""
from __future__ import annotations

from pathlib import Path

import torch
from arch_helpers import make_arch_model
from conftest import make_byte_tokenizer, make_hf_model

from compiler.formats.gguf_block import GgufLinear
from compiler.formats.int4 import Int4Linear

SLIDING, FULL = "sliding_attention", "full_attention"
# 256-wide rows, so Q4_K/Q6_K's super-blocks divide them; Gemma 3's six layers: llama.cpp's pattern (6th full).
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
ARCHS = {
    "llama": lambda vocab: make_hf_model("llama", vocab_size=vocab, **SHAPE),
    "qwen2": lambda vocab: make_hf_model("qwen2", vocab_size=vocab, **SHAPE),
    "qwen3": lambda vocab: make_arch_model("qwen3", vocab_size=vocab, **SHAPE, head_dim=64),
    "gemma3": lambda vocab: make_arch_model("gemma3", vocab_size=vocab, **{**SHAPE, "num_hidden_layers": 6},
                                            head_dim=64, query_pre_attn_scalar=64, sliding_window=8,
                                            layer_types=[SLIDING] * 5 + [FULL]),
}
# Mixture-of-experts: llama.cpp's qwen3moe, and Mixtral as its llama with stacked experts.
MOE_ARCHS = {
    "qwen3-moe": lambda vocab: make_arch_model("qwen3-moe", vocab_size=vocab, **SHAPE, moe_intermediate_size=256),
    "mixtral": lambda vocab: make_arch_model("mixtral", vocab_size=vocab, **SHAPE),
}
# Fast settings: the pass's machinery on every grid, not its full search.
FAST_AWQ = {"alpha_grid": 4, "clip_grid": 4, "module_candidates": 0, "search_tokens": 512}


def save_checkpoint(root: Path, arch: str) -> Path:
    tokenizer = make_byte_tokenizer()
    model = {**ARCHS, **MOE_ARCHS}[arch](len(tokenizer))
    if arch in ("llama", "qwen2"):  # transformers' 0.02 init makes near-uniform logits: widen them for clear argmaxes
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.08)
    path = root / f"ckpt-{arch}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def compile_awq(checkpoint: Path, out: Path, **awq) -> Path:
    import passes  # noqa: F401
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    config = {"calibration": {"samples": 4, "seq_len": 64}, "passes": [{"name": "awq", **FAST_AWQ, **awq}],
              "target": {"name": "gguf"}}
    return compile_model(checkpoint, PipelineConfig.from_dict(config), out).path


def _round_to_int8(x: torch.Tensor, block: int) -> torch.Tensor:
    shape = x.shape
    x = x.float().reshape(-1, block)
    d = x.abs().amax(-1, keepdim=True) / 127
    return ((x / torch.where(d == 0, 1.0, d)).round() * d).reshape(shape)


def llama_cpp_reference(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with each quantized layer computing llama.cpp's way (module docstring): its input
    rounded to int8 per block, times its dequantized weight in float32 (no engine kernel)."""
    for m in model.modules():
        if isinstance(m, (GgufLinear, Int4Linear)):
            block = 256 if isinstance(m, GgufLinear) and m.type.super == 256 else 32
            weight = m.dequantized_weight().float()
            m.forward = lambda x, w=weight, block=block, bias=m.bias: torch.nn.functional.linear(
                _round_to_int8(x, block), w, None if bias is None else bias.float())
    return model


def greedy_llama_cpp(llm, prompt: list[int], tokens: int) -> list[int]:
    """``tokens`` greedy tokens of llama.cpp (a ``llama_cpp.Llama`` made with ``logits_all``) after ``prompt``."""
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(tokens):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out
