"""The paged-decode kernels against ``paged_decode_reference`` (``serving/paged_attention.py``): the
OpenAI Triton kernel (``compiler/kernels/paged_decode.py``) and the C++ CPU kernel
(``compiler/kernels/cpu_ext.py``), on fresh random paged K/V (relative error printed, -s).

The Triton kernel runs on ``kernel_device``: compiled on a CUDA GPU, else on the CPU under
``TRITON_INTERPRET=1`` (set by tests/conftest.py before any import, since ``triton.jit`` picks the
interpreter when it decorates). Bounds: ``KERNEL_BOUNDS`` (tests/paged_helpers.py).
"""
from __future__ import annotations

import pytest
import torch
from numerics import relative_error
from paged_helpers import KERNEL_BOUNDS, scatter_sequences

from compiler.kernels.cpu_ext import paged_decode_cpu
from serving.paged_attention import paged_decode_reference, quantize_kv


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


def on(device, *tensors):
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("hq,hkv,d,bs,window", [(4, 2, 16, 4, None), (6, 3, 12, 16, None), (4, 4, 8, 8, 6), (8, 1, 32, 5, None)])
def test_triton_decode_matches_reference(triton_kernel, kernel_device, hq, hkv, d, bs, window):
    lens = [1, 5, 17, 33, 40]  # mixed lengths: partial blocks, single token, several blocks
    k_cache, v_cache, tables, _ = scatter_sequences(lens, 64, bs, hkv, d, seed=hq + bs)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(hq * d))
    seq_lens = torch.tensor(lens)
    want = paged_decode_reference(q, k_cache, v_cache, tables, seq_lens, sliding_window=window)
    got = triton_kernel(*on(kernel_device, q, k_cache, v_cache, tables, seq_lens), sliding_window=window)
    assert got.device.type == kernel_device and relative_error(got, want) < KERNEL_BOUNDS[kernel_device]


def fp8_caches(lens: list[int], per_head: bool, hkv=2, d=16, bs=4):
    """Float caches of sequences of ``lens`` tokens scattered in blocks, their E4M3 copies, the
    block tables and the scale (one per KV head, or one for all)."""
    k_cache, v_cache, tables, _ = scatter_sequences(lens, 24, bs, hkv, d)
    scale = torch.tensor([[0.01], [0.02]]) if per_head else torch.tensor([[0.015]])
    k8 = quantize_kv(k_cache.view(-1, hkv, d), torch.float8_e4m3fn, scale).view(k_cache.shape)
    v8 = quantize_kv(v_cache.view(-1, hkv, d), torch.float8_e4m3fn, scale).view(v_cache.shape)
    return k_cache, v_cache, k8, v8, tables, scale


@pytest.mark.parametrize("per_head", [False, True])
def test_triton_decode_fp8_matches_reference(triton_kernel, kernel_device, per_head):
    lens, hq, d = [3, 20, 9], 4, 16
    k_cache, v_cache, k8, v8, tables, scale = fp8_caches(lens, per_head, d=d)
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
    lens, hq, d = [3, 20, 9], 4, 16
    _, _, k8, v8, tables, scale = fp8_caches(lens, per_head, d=d)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(int(per_head))).to(q_dtype)
    want = paged_decode_reference(q.float(), k8, v8, tables, torch.tensor(lens), scale, scale)
    got = paged_decode_cpu(q, k8, v8, tables, torch.tensor(lens), scale, scale)
    err = relative_error(got.float(), want)
    print(f"fp8 per_head={per_head} q {q_dtype}: relative error {err:.2e}")
    assert got.dtype == q_dtype and err < (KERNEL_BOUNDS["cpu"] if q_dtype == torch.float32 else 1e-2)


def test_cpu_decode_reads_every_fp8_code_exactly(cpu_ops):
    """One cached token per sequence, so the output is its V row times the scale: each of the 256
    E4M3 codes (subnormals, -0, NaN included) as torch's cast reads it."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(16, 1, 1, 16)
    keys, scale = torch.zeros_like(codes), torch.tensor([0.37])
    out = paged_decode_cpu(torch.zeros(16, 1, 16), keys, codes, torch.arange(16)[:, None], torch.ones(16, dtype=torch.long),
                           scale, scale)
    want = codes.float().reshape(16, 1, 16) * scale
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())


def test_cpu_decode_refuses_a_table_that_points_outside_the_cache(cpu_ops):
    k_cache, v_cache, tables, _ = scatter_sequences([5], 4, 4, 1, 8)
    q = torch.randn(1, 2, 8)
    with pytest.raises(RuntimeError, match="block table entry out of range"):
        paged_decode_cpu(q, k_cache, v_cache, torch.tensor([[1, 4]]), torch.tensor([5]))
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\] = 9 is outside \[1, 8\]"):
        paged_decode_cpu(q, k_cache, v_cache, tables, torch.tensor([9]))


def test_cpu_decode_lets_nan_through(cpu_ops):
    k_cache, v_cache, tables, _ = scatter_sequences([6], 4, 4, 1, 8)
    k_cache[tables[0, 0], 2, 0, 3] = float("nan")
    out = paged_decode_cpu(torch.randn(1, 2, 8), k_cache, v_cache, tables, torch.tensor([6]))
    assert torch.isnan(out).all()
