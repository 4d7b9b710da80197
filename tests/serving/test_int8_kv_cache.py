"""The engine's INT8 paged KV cache (the int8 pass's ``kv_cache`` entry, vllm-ascend's "C8"):
int8 codes per channel written as the model's ``Int8KVQuant`` rounds, the C++ decode kernel's int8
reads against the torch reference at every ISA level this CPU runs (relative error printed, -s),
and the engine end to end: the same greedy tokens as the model's hook over a float32 cache, in a
quarter of the memory."""
from __future__ import annotations

import json

import pytest
import torch
from artifact_helpers import rewrite_manifest
from conftest import kernel_levels, kernels_at
from numerics import relative_error
from paged_helpers import KERNEL_BOUNDS, int8_kv_entry, scatter_sequences
from test_serving_engine import _compile, prompts_of, reference, run_staggered

from compiler.formats.kv_quant import Int8KVQuant
from compiler.kernels.cpu_ext import paged_decode_cpu, use_isa
from serving.engine import Engine
from serving.paged_attention import dequantize_kv, paged_decode_reference, quantize_kv


def channel_scales(hkv: int, d: int, seed: int) -> torch.Tensor:
    """Per-channel scales [Hkv, D], each its own (a kernel reading one scale per head would be caught)."""
    return 0.004 + 0.03 * torch.rand(hkv, d, generator=torch.Generator().manual_seed(seed))


def int8_caches(lens: list[int], hkv: int, d: int, bs: int, seed: int):
    """Int8 K and V caches of sequences of ``lens`` tokens scattered in blocks, their tables and scales."""
    k_cache, v_cache, tables, _ = scatter_sequences(lens, 64, bs, hkv, d, seed=seed)
    k_scale, v_scale = channel_scales(hkv, d, seed), channel_scales(hkv, d, seed + 1)
    k8 = quantize_kv(k_cache.view(-1, hkv, d), torch.int8, k_scale).view(k_cache.shape)
    v8 = quantize_kv(v_cache.view(-1, hkv, d), torch.int8, v_scale).view(v_cache.shape)
    return k8, v8, tables, k_scale, v_scale


def test_written_codes_read_back_as_the_models_int8_rounding():
    """``quantize_kv`` then ``dequantize_kv`` is ``Int8KVQuant`` bit for bit; ties round to even, and
    values past the range clamp to [-128, 127]."""
    hkv, d = 3, 16
    scale = channel_scales(hkv, d, 0)
    scale[0] = 2.0**-7  # head 0: x * (1 / scale) exact, so ties stay ties
    x = torch.randn(40, hkv, d, generator=torch.Generator().manual_seed(1)) * 2
    x[0] = (torch.arange(d) - 8.5) * 2.0**-7  # -8.5, -7.5, ..., 6.5 times the scale
    x[1] = 3 * scale * 127 * torch.where(torch.arange(d) % 2 == 0, 1, -1)
    quant = Int8KVQuant(scale.flatten(), scale.flatten())
    want, _ = quant(x.transpose(0, 1)[None], x.transpose(0, 1)[None])  # [1, Hkv, T, D]
    codes = quantize_kv(x, torch.int8, scale)
    assert codes.dtype == torch.int8
    assert codes[0, 0].tolist() == [-8, -8, -6, -6, -4, -4, -2, -2, 0, 0, 2, 2, 4, 4, 6, 6]
    assert codes[1].tolist() == [[127, -128] * (d // 2)] * hkv
    assert torch.equal(dequantize_kv(codes, torch.float32, scale), want[0].transpose(0, 1))


# head sizes and groups: the register-blocked kernels (D % 64 == 0, G <= 8) and the general ones,
# D = 12 and 40 with a row tail past the last 16 codes
@pytest.mark.parametrize("hq,hkv,d,bs,window", [(4, 2, 16, 4, None), (6, 3, 12, 16, None), (4, 4, 40, 8, 6),
                                                 (9, 3, 64, 16, 7), (8, 2, 128, 16, None), (16, 1, 64, 5, None)])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_int8_matches_reference(cpu_ops, isa, hq, hkv, d, bs, window, q_dtype):
    lens = [1, 5, 17, 33, 40]
    k8, v8, tables, k_scale, v_scale = int8_caches(lens, hkv, d, bs, seed=hq + d)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(hq * d)).to(q_dtype)
    seq_lens = torch.tensor(lens)
    want = paged_decode_reference(q.float(), k8, v8, tables, seq_lens, k_scale, v_scale, window)
    got = paged_decode_cpu(q, k8, v8, tables, seq_lens, k_scale, v_scale, window)
    err = relative_error(got.float(), want)
    print(f"int8 [{isa}] hq={hq} hkv={hkv} d={d} bs={bs} window={window} q {q_dtype}: relative error {err:.2e}")
    assert got.dtype == q_dtype and err < (KERNEL_BOUNDS["cpu"] if q_dtype == torch.float32 else 1e-2)


def test_cpu_decode_reads_every_int8_code_exactly(cpu_ops):
    """One cached token per sequence, so the output is its V row dequantized: each of the 256 codes
    times its channel's scale, as torch's ``codes.float() * scale`` (D = 20: a vector and a tail)."""
    d = 20
    codes = torch.arange(-128, 128, dtype=torch.int16)[torch.randperm(256, generator=torch.Generator().manual_seed(2))]
    codes = torch.cat([codes, codes[:64]]).to(torch.int8).reshape(16, 1, 1, d)
    scale = channel_scales(1, d, 3)
    out = paged_decode_cpu(torch.zeros(16, 1, d), torch.zeros_like(codes), codes, torch.arange(16)[:, None],
                           torch.ones(16, dtype=torch.long), scale, scale)
    assert torch.equal(out, codes.float().reshape(16, 1, d) * scale)


def test_cpu_decode_refuses_per_head_scales_for_an_int8_cache(cpu_ops):
    k8, v8, tables, _, _ = int8_caches([5], 2, 16, 4, seed=0)
    with pytest.raises(RuntimeError, match=r"Hkv \* D for an int8 cache"):
        paged_decode_cpu(torch.randn(1, 2, 16), k8, v8, tables, torch.tensor([5]), torch.ones(2, 1), torch.ones(2, 1))



@pytest.mark.parametrize("kernel", ["torch", "cpu"])
@torch.no_grad()
def test_engine_serves_an_int8_cache_with_the_hooks_tokens(tiny_checkpoint, tmp_path, kernel):
    """An artifact with an INT8 KV entry: the engine stores int8 codes (a quarter of float32's bytes a
    block, so four times the blocks in one budget), drops the model's hook, and its greedy tokens under
    continuous batching (chunked prefill, decodes) are those of the model with the hook over a float32
    cache, through the C++ kernel (at the best level this CPU runs) and the torch reference alike."""
    path, _ = tiny_checkpoint()
    art = _compile(path, tmp_path / "art", [{"name": "paged_kv", "block_size": 4, "kv_memory_mb": 0.25}])
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["kv_cache"] = int8_kv_entry(Engine.from_artifact(art, "cpu").model)
    manifest["serving"].update(kv_dtype="auto", num_blocks=None)
    rewrite_manifest(art, manifest)
    with use_isa(None) if kernel == "torch" else kernels_at(kernel_levels()[-1]):
        int8 = Engine.from_artifact(art, "cpu", max_num_batched_tokens=16)
        hooked = Engine.from_artifact(art, "cpu", max_num_batched_tokens=16, kv_dtype="float32")  # hook, float cache
        assert int8.cache.decode_kernel == kernel
        assert int8.cache.k[0].dtype == int8.cache.v[1].dtype == torch.int8
        assert int8.load_report.kv_cache.kv_dtype == "int8" and int8.load_report.kv_rounding_dropped
        assert int8.model.layers[0].self_attn.kv_quant is None
        assert isinstance(hooked.model.layers[0].self_attn.kv_quant, Int8KVQuant)
        assert hooked.cache.k[0].dtype == torch.float32
        assert int8.load_report.kernels["kv_cache"] == "int8 codes with the artifact's scales, dequantized on read"
        assert 4 * int8.cache.spec.bytes_per_block == hooked.cache.spec.bytes_per_block
        assert int8.cache.spec.num_blocks == 4 * hooked.cache.spec.num_blocks  # the same 0.25 MiB
        prompts = prompts_of([7, 19, 3, 26], seed=9)
        want = [reference(hooked.model, p, 12) for p in prompts]
        assert run_staggered(hooked, prompts) == want
        assert run_staggered(int8, prompts) == want
        for layer in hooked.model.layers:  # the rounding changes these tokens: the parity above is the INT8 cache's
            layer.self_attn.kv_quant = None
        assert [reference(hooked.model, p, 12) for p in prompts] != want
