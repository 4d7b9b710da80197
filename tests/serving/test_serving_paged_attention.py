"""Paged attention (``serving/paged_attention.py``, ``serving/paged_cache.py``) against dense attention,
and the paged cache's decode paths against the reference. The decode kernels' own tests (Triton,
C++ CPU) are in tests/compiler/kernels/test_paged_decode.py.
"""
from __future__ import annotations

import pytest
import torch
from conftest import kernel_levels, kernels_at
from numerics import relative_error
from paged_helpers import KERNEL_BOUNDS, scatter_sequences

from compiler.model.kv_cache import attention_mask, sdpa
from serving.paged_attention import (
    dequantize_kv,
    paged_decode_reference,
    paged_prefill_reference,
    quantize_kv,
)
from serving.paged_cache import BatchMetadata, KVCacheSpec, PagedKVCache, PrefillSeq


@pytest.mark.parametrize("window", [None, 5])
def test_decode_reference_matches_dense(window):
    lens, hq, hkv, d, bs = [1, 7, 16, 23], 4, 2, 8, 4
    k_cache, v_cache, tables, dense = scatter_sequences(lens, 40, bs, hkv, d)
    q = torch.randn(len(lens), hq, d)
    out = paged_decode_reference(q, k_cache, v_cache, tables, torch.tensor(lens), sliding_window=window)
    for i, (k, v) in enumerate(dense):
        n = lens[i]
        mask = attention_mask(torch.tensor([[n - 1]]), torch.arange(n)[None], window)
        want = sdpa(q[i][None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask)[0, :, 0]
        assert relative_error(out[i], want) < 1e-5


def test_prefill_reference_matches_causal_dense():
    hq, hkv, d, bs, n = 4, 2, 8, 4, 19
    k_cache, v_cache, tables, dense = scatter_sequences([n], 10, bs, hkv, d)
    k, v = dense[0]
    q = torch.randn(hq, 6, d)  # the last 6 positions, as a chunk after 13 cached tokens
    out = paged_prefill_reference(q, k_cache, v_cache, tables[0], torch.arange(13, 19), n)
    mask = attention_mask(torch.arange(13, 19)[None], torch.arange(n)[None], None)
    want = sdpa(q[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask)[0]
    assert relative_error(out, want) < 1e-5


def test_fp8_roundtrip_error_is_small():
    x = torch.randn(64, 2, 16)
    scale = x.abs().amax(dim=(0, 2))[:, None] / 448.0
    y = dequantize_kv(quantize_kv(x, torch.float8_e4m3fn, scale), torch.float32, scale)
    assert relative_error(y, x) < 0.05


def test_paged_cache_attend_mixes_decode_and_prefill():
    """One flattened batch: a 3-token prefill chunk of seq A and a decode of seq B, vs dense attention."""
    hq, hkv, d, bs = 4, 2, 8, 4
    spec = KVCacheSpec(1, 8, bs, hkv, d, torch.float32)
    cache = PagedKVCache(spec)
    g = torch.Generator().manual_seed(0)
    # B already has 5 tokens cached in blocks [3, 6]; its 6th comes now. A is new, blocks [1].
    kb, vb = torch.randn(6, hkv, d, generator=g), torch.randn(6, hkv, d, generator=g)
    for p in range(5):
        cache.k[0][[3, 6][p // bs], p % bs], cache.v[0][[3, 6][p // bs], p % bs] = kb[p], vb[p]
    ka, va = torch.randn(3, hkv, d, generator=g), torch.randn(3, hkv, d, generator=g)
    q = torch.randn(1, hq, 4, d, generator=g)
    k = torch.cat([ka, kb[5:]]).transpose(0, 1)[None]
    v = torch.cat([va, vb[5:]]).transpose(0, 1)[None]
    positions = torch.tensor([[0, 1, 2, 5]])
    cache.set_batch(BatchMetadata(slot_mapping=torch.tensor([4, 5, 6, 6 * bs + 1]), decode_token_idx=torch.tensor([3]),
                                  decode_block_tables=torch.tensor([[3, 6]]), decode_seq_lens=torch.tensor([6]),
                                  prefills=[PrefillSeq(0, 3, 3, torch.tensor([1]))]))
    out = cache.attend(0, q, k, v, positions)
    want_a = sdpa(q[:, :, :3], ka.transpose(0, 1)[None], va.transpose(0, 1)[None], None, causal=True)
    want_b = sdpa(q[:, :, 3:], kb.transpose(0, 1)[None], vb.transpose(0, 1)[None], None)
    assert relative_error(out[:, :, :3], want_a) < 1e-5 and relative_error(out[:, :, 3:], want_b) < 1e-5


@pytest.mark.parametrize("kernel", ["torch", *(f"cpu-{level}" for level in kernel_levels())])
@pytest.mark.parametrize("window", [None, 6])
def test_decode_only_steps_equal_the_reference(kernel, window):
    """A decode-only step (no query gather; on the torch path the step's mask and gather buffers
    shared by the layers) gives the reference's output — bit for bit on the torch path — in every
    layer and again after the batch shrinks; the C++ kernel at each ISA level the CPU runs."""
    if kernel == "torch":
        return decode_only_steps(kernel, window)
    level = kernel.removeprefix("cpu-")
    with kernels_at(None if level == "None" else level):
        decode_only_steps("cpu", window)


def decode_only_steps(kernel: str, window: int | None) -> None:
    hq, hkv, d, bs = 4, 2, 8, 4
    lens = [3, 17, 9]
    k_cache, v_cache, tables, _ = scatter_sequences(lens, 24, bs, hkv, d, seed=7)
    cache = PagedKVCache(KVCacheSpec(2, 24, bs, hkv, d, torch.float32), sliding_window=window, decode_kernel=kernel)
    g = torch.Generator().manual_seed(8)
    for rows in (slice(0, 3), slice(1, 2)):  # three sequences, then one: the buffers are views of the first
        t, lens_t = tables[rows], torch.tensor(lens)[rows]
        slots = torch.tensor([int(t[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens_t.tolist())])
        cache.set_batch(BatchMetadata(slot_mapping=slots, decode_token_idx=torch.arange(len(slots)),
                                      decode_block_tables=t, decode_seq_lens=lens_t))
        for layer in range(2):
            cache.k[layer].copy_(k_cache)
            cache.v[layer].copy_(v_cache)
            q = torch.randn(1, hq, len(slots), d, generator=g)
            k, v = torch.randn(1, hkv, len(slots), d, generator=g), torch.randn(1, hkv, len(slots), d, generator=g)
            out = cache.attend(layer, q, k, v, torch.tensor([lens_t.tolist()]) - 1)
            want = paged_decode_reference(q[0].transpose(0, 1), cache.k[layer], cache.v[layer], t, lens_t,
                                          sliding_window=window)
            got = out[0].transpose(0, 1)
            assert torch.equal(got, want) if kernel == "torch" else relative_error(got, want) < KERNEL_BOUNDS["cpu"]


def test_engine_decodes_through_the_triton_kernel(kernel_device, tiny_checkpoint):
    """The engine's CUDA path (decode via the kernel; on the CPU, run by the interpreter): the greedy
    tokens of the torch model on the CPU."""
    pytest.importorskip("triton")
    from compiler.io.load import load_checkpoint
    from serving.engine import Engine

    path, _ = tiny_checkpoint("qwen2")
    loaded = load_checkpoint(path)
    prompts = [[5, 9, 14], [7, 8, 9, 10, 11, 12, 13]]
    want = [loaded.model.generate(torch.tensor([p]), 6)[0, len(p):].tolist() for p in prompts]
    engine = Engine.from_loaded(loaded, kernel_device, block_size=4, num_blocks=32)
    engine.cache.decode_kernel = "triton"
    got = [engine.generate(prompt_token_ids=p, max_tokens=6, ignore_eos=True).token_ids for p in prompts]
    assert got == want


def test_an_unknown_decode_kernel_is_refused():
    with pytest.raises(ValueError, match="decode_kernel 'cuda': one of triton, cpu, torch"):
        PagedKVCache(KVCacheSpec(1, 4, 4, 1, 8, torch.float32), decode_kernel="cuda")
