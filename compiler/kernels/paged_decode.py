"""An OpenAI Triton paged-attention decode kernel (one query token per sequence).

One program per (sequence, query head) walks the sequence's block table, loads each block's
keys and values for the head's KV head (grouped-query attention: ``kv_head = head // group``),
and keeps an online softmax (running max, running sum, running weighted values) in fp32, so
the whole context never has to fit in registers. FP8 caches are dequantized on load with a
per-KV-head scale. Checked against ``paged_decode_reference`` (on the CPU with
``TRITON_INTERPRET=1``); the engine uses it on CUDA (``serving/paged_cache.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
                         sm_scale, window,
                         stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_bts, stride_os, stride_oh,
                         GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_T)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + head * stride_qh + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    k_scale = tl.load(k_scale_ptr + kv_head)
    v_scale = tl.load(v_scale_ptr + kv_head)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0
    if window > 0:  # sliding window: keys at positions > seq_len - 1 - window only
        first = tl.maximum(seq_len - window, 0) // BLOCK_SIZE
    m_i = tl.full([1], -1e30, tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in range(first, tl.cdiv(seq_len, BLOCK_SIZE)):
        block_id = tl.load(block_tables_ptr + seq * stride_bts + j)
        pos = j * BLOCK_SIZE + offs_t
        valid = (offs_t < BLOCK_SIZE) & (pos < seq_len)
        if window > 0:
            valid = valid & (pos > seq_len - 1 - window)
        base = block_id.to(tl.int64) * stride_kb + kv_head * stride_kh
        ptrs = base + offs_t[:, None] * stride_kt + offs_d[None, :]
        m2 = valid[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + ptrs, mask=m2, other=0.0).to(tl.float32) * k_scale  # [BLOCK_T, BLOCK_D]
        v = tl.load(v_ptr + ptrs, mask=m2, other=0.0).to(tl.float32) * v_scale
        scores = tl.sum(k * q[None, :], axis=1) * sm_scale
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def paged_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        sliding_window: int | None = None) -> torch.Tensor:
    """Same contract as ``paged_decode_reference``: q [S, Hq, D] -> [S, Hq, D]."""
    if triton is None:
        raise RuntimeError("the Triton paged-decode kernel needs the 'triton' package")
    S, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    q = q.contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    ones = torch.ones(Hkv, dtype=torch.float32, device=q.device)
    ks = ones if k_scale is None else k_scale.float().reshape(-1).expand(Hkv).contiguous()
    vs = ones if v_scale is None else v_scale.float().reshape(-1).expand(Hkv).contiguous()
    out = torch.empty_like(q)
    _paged_decode_kernel[(S, Hq)](
        q, k_cache, v_cache, out, block_tables, seq_lens, ks, vs, D ** -0.5, sliding_window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=Hq // Hkv, BLOCK_SIZE=bs, BLOCK_T=triton.next_power_of_2(bs), HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
    )
    return out
