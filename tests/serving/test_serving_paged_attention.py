"""Paged attention against dense attention, and the decode kernels (Triton, C++ CPU) against the torch reference.

The Triton kernel runs on ``kernel_device``: compiled on a CUDA GPU, else on the CPU under
``TRITON_INTERPRET=1`` (set by tests/conftest.py before any import, since ``triton.jit`` picks the
interpreter when it decorates). Bounds (``KERNEL_BOUNDS``): float32 sums in both; the GPU's
``tl.exp`` is an approximate exp2 (a few ulp), hence the looser bound there. The C++ kernel
(``compiler/kernels/cpu_ext.py``) computes in float32 whatever the cache's dtype: the same bound
as the CPU's.
"""
from __future__ import annotations

import pytest
import torch
from numerics import relative_error

from compiler.model.kv_cache import attention_mask, sdpa
from serving.paged_attention import (
    dequantize_kv,
    paged_decode_reference,
    paged_prefill_reference,
    quantize_kv,
)
from serving.paged_cache import BatchMetadata, KVCacheSpec, PagedKVCache, PrefillSeq

KERNEL_BOUNDS = {"cpu": 1e-5, "cuda": 1e-4}


def scatter_sequences(lens, n_blocks, bs, hkv, d, seed=0):
    """Random dense K/V per sequence, written into randomly placed blocks; returns caches, tables, dense."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(n_blocks, bs, hkv, d, generator=g)  # garbage in unused slots
    v_cache = torch.randn(n_blocks, bs, hkv, d, generator=g)
    perm = torch.randperm(n_blocks, generator=g).tolist()
    width = max(-(-n // bs) for n in lens)
    tables, dense = [], []
    for n in lens:
        ids = [perm.pop() for _ in range(-(-n // bs))]
        k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
        for p in range(n):
            k_cache[ids[p // bs], p % bs], v_cache[ids[p // bs], p % bs] = k[p], v[p]
        tables.append(ids + [0] * (width - len(ids)))
        dense.append((k, v))
    return k_cache, v_cache, torch.tensor(tables), dense


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


def on(device, *tensors):
    return [t.to(device) for t in tensors]


@pytest.fixture
def triton_kernel():
    pytest.importorskip("triton")
    import compiler.kernels.paged_decode as mod

    # tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton; on a GPU host
    # (TRITON_INTERPRET=0) the compiled kernel runs instead.
    assert _interpreted(mod._paged_decode_kernel) or torch.cuda.is_available(), "TRITON_INTERPRET=1 was not set before triton's import"
    return mod.paged_decode_triton


def _interpreted(fn) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(fn, InterpretedFunction)


@pytest.mark.parametrize("hq,hkv,d,bs,window", [(4, 2, 16, 4, None), (6, 3, 12, 16, None), (4, 4, 8, 8, 6), (8, 1, 32, 5, None)])
def test_triton_decode_matches_reference(triton_kernel, kernel_device, hq, hkv, d, bs, window):
    lens = [1, 5, 17, 33, 40]  # mixed lengths: partial blocks, single token, several blocks
    k_cache, v_cache, tables, _ = scatter_sequences(lens, 64, bs, hkv, d, seed=hq + bs)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(hq * d))
    seq_lens = torch.tensor(lens)
    want = paged_decode_reference(q, k_cache, v_cache, tables, seq_lens, sliding_window=window)
    got = triton_kernel(*on(kernel_device, q, k_cache, v_cache, tables, seq_lens), sliding_window=window)
    assert got.device.type == kernel_device and relative_error(got, want) < KERNEL_BOUNDS[kernel_device]


@pytest.mark.parametrize("per_head", [False, True])
def test_triton_decode_fp8_matches_reference(triton_kernel, kernel_device, per_head):
    lens, hq, hkv, d, bs = [3, 20, 9], 4, 2, 16, 4
    k_cache, v_cache, tables, _ = scatter_sequences(lens, 24, bs, hkv, d)
    scale = torch.tensor([[0.01], [0.02]]) if per_head else torch.tensor([[0.015]])
    k8 = quantize_kv(k_cache.view(-1, hkv, d), torch.float8_e4m3fn, scale).view(k_cache.shape)
    v8 = quantize_kv(v_cache.view(-1, hkv, d), torch.float8_e4m3fn, scale).view(v_cache.shape)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(int(per_head)))
    want = paged_decode_reference(q, k8, v8, tables, torch.tensor(lens), scale, scale)
    got = triton_kernel(*on(kernel_device, q, k8, v8, tables, torch.tensor(lens), scale, scale))
    assert relative_error(got, want) < KERNEL_BOUNDS[kernel_device]
    exact = paged_decode_reference(q, k_cache, v_cache, tables, torch.tensor(lens))
    assert relative_error(want, exact) < 0.1  # FP8 storage costs precision, not correctness


# head sizes and groups: the register-blocked kernels (D % 64 == 0, G <= 8: G = 3, 4, 1) and the general ones
@pytest.mark.parametrize("hq,hkv,d,bs,window", [(4, 2, 16, 4, None), (6, 3, 12, 16, None), (4, 4, 8, 8, 6),
                                                 (8, 1, 32, 5, None), (9, 3, 64, 16, 7), (8, 2, 128, 16, None),
                                                 (2, 2, 64, 3, 9), (16, 1, 64, 16, None)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_decode_matches_reference(cpu_ops, hq, hkv, d, bs, window, cache_dtype):
    from compiler.kernels.cpu_ext import paged_decode_cpu

    lens = [1, 5, 17, 33, 40]
    k_cache, v_cache, tables, _ = scatter_sequences(lens, 64, bs, hkv, d, seed=hq + bs)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(hq * d))
    seq_lens = torch.tensor(lens)
    want = paged_decode_reference(q, k_cache, v_cache, tables, seq_lens, sliding_window=window)
    got = paged_decode_cpu(q, k_cache, v_cache, tables, seq_lens, sliding_window=window)
    err = relative_error(got, want)
    print(f"hq={hq} hkv={hkv} d={d} bs={bs} window={window} {cache_dtype}: relative error {err:.2e}")
    assert got.dtype == q.dtype and err < KERNEL_BOUNDS["cpu"]


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_fp8_matches_reference(cpu_ops, per_head, q_dtype):
    from compiler.kernels.cpu_ext import paged_decode_cpu

    lens, hq, hkv, d, bs = [3, 20, 9], 4, 2, 16, 4
    k_cache, v_cache, tables, _ = scatter_sequences(lens, 24, bs, hkv, d)
    scale = torch.tensor([[0.01], [0.02]]) if per_head else torch.tensor([[0.015]])
    k8 = quantize_kv(k_cache.view(-1, hkv, d), torch.float8_e4m3fn, scale).view(k_cache.shape)
    v8 = quantize_kv(v_cache.view(-1, hkv, d), torch.float8_e4m3fn, scale).view(v_cache.shape)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(int(per_head))).to(q_dtype)
    want = paged_decode_reference(q.float(), k8, v8, tables, torch.tensor(lens), scale, scale)
    got = paged_decode_cpu(q, k8, v8, tables, torch.tensor(lens), scale, scale)
    err = relative_error(got.float(), want)
    print(f"fp8 per_head={per_head} q {q_dtype}: relative error {err:.2e}")
    assert got.dtype == q_dtype and err < (KERNEL_BOUNDS["cpu"] if q_dtype == torch.float32 else 1e-2)


def test_cpu_decode_reads_every_fp8_code_exactly(cpu_ops):
    """One cached token per sequence, so the output is its V row times the scale: each of the 256
    E4M3 codes (subnormals, -0, NaN included) as torch's cast reads it."""
    from compiler.kernels.cpu_ext import paged_decode_cpu

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(16, 1, 1, 16)
    keys, scale = torch.zeros_like(codes), torch.tensor([0.37])
    out = paged_decode_cpu(torch.zeros(16, 1, 16), keys, codes, torch.arange(16)[:, None], torch.ones(16, dtype=torch.long),
                           scale, scale)
    want = codes.float().reshape(16, 1, 16) * scale
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())


def test_cpu_decode_refuses_a_table_that_points_outside_the_cache(cpu_ops):
    from compiler.kernels.cpu_ext import paged_decode_cpu

    k_cache, v_cache, tables, _ = scatter_sequences([5], 4, 4, 1, 8)
    q = torch.randn(1, 2, 8)
    with pytest.raises(RuntimeError, match="block table entry out of range"):
        paged_decode_cpu(q, k_cache, v_cache, torch.tensor([[1, 4]]), torch.tensor([5]))
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = 9 is outside \[1, 8\]"):
        paged_decode_cpu(q, k_cache, v_cache, tables, torch.tensor([9]))


def test_cpu_decode_lets_nan_through(cpu_ops):
    from compiler.kernels.cpu_ext import paged_decode_cpu

    k_cache, v_cache, tables, _ = scatter_sequences([6], 4, 4, 1, 8)
    k_cache[tables[0, 0], 2, 0, 3] = float("nan")
    out = paged_decode_cpu(torch.randn(1, 2, 8), k_cache, v_cache, tables, torch.tensor([6]))
    assert torch.isnan(out).all()


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


@pytest.mark.parametrize("kernel", ["torch", "cpu"])
@pytest.mark.parametrize("window", [None, 6])
def test_decode_only_steps_equal_the_reference(request, kernel, window):
    """A decode-only step (no query gather; on the torch path the step's mask and gather buffers
    shared by the layers) gives the reference's output — bit for bit on the torch path — in every
    layer and again after the batch shrinks."""
    if kernel == "cpu":
        request.getfixturevalue("cpu_ops")
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


def test_engine_decodes_through_the_triton_kernel(triton_kernel, kernel_device, tiny_checkpoint):
    """The engine's CUDA path (decode via the kernel; on the CPU, run by the interpreter): the greedy
    tokens of the torch model on the CPU."""
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
