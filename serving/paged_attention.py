"""Paged attention in plain torch: the reference every kernel is checked against, and the CPU path.

Cache layout (vLLM's): per layer, K and V are ``[num_blocks, block_size, Hkv, D]``; token slot
``s = block_id * block_size + offset`` is row ``s`` of the flattened ``[num_blocks * block_size,
Hkv, D]`` view. A sequence's block table lists its block ids in token order.

Quantized KV: K/V are stored as codes and read back as ``codes * scale``: ``float8_e4m3fn`` codes
of ``x / scale`` with ``scale`` broadcastable to ``[Hkv, 1]`` (per tensor or per head), or int8
codes of ``x * (1 / scale)`` rounded half to even and clamped (``compiler/formats/kv_quant.py``'s
``int8_codes``) with ``scale`` ``[Hkv, D]`` (per channel).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from compiler.formats.kv_quant import int8_codes
from compiler.model.kv_cache import attention_mask
from compiler.quant.fp8 import to_float32

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """x: [T, Hkv, D] in compute dtype -> storage dtype (scaled and clamped for FP8; for int8 the
    codes of the model's ``Int8KVQuant``, bit for bit)."""
    if scale is None:
        return x.to(dtype)
    if dtype == torch.int8:
        return int8_codes(x, 1 / scale)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Stored [..., Hkv, D] -> compute dtype."""
    if scale is None:
        return x.to(dtype)
    return ((x.float() if x.dtype == torch.int8 else to_float32(x)) * scale).to(dtype)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """cache [N, bs, H, D], block_tables [S, M] -> [S, M * bs, H, D] (each sequence's tokens in order).

    ``out``: a tensor of ``S * M * bs * H * D`` elements in the cache's dtype to write into (the paged
    cache reuses one per step for every layer instead of allocating megabytes per call)."""
    S, M = block_tables.shape
    # index_select on a 2-d view copies whole blocks: on the CPU 2.3x faster than cache[block_tables].
    flat = cache.reshape(cache.shape[0], -1)  # a view of the paged cache; a copy of expanded MLA blocks
    if out is None:
        g = flat.index_select(0, block_tables.reshape(-1))
    else:
        g = torch.index_select(flat, 0, block_tables.reshape(-1), out=out.view(S * M, flat.shape[1]))
    return g.view(S, M * cache.shape[1], *cache.shape[2:])


def decode_mask(seq_lens: torch.Tensor, num_tokens: int, sliding_window: int | None) -> torch.Tensor:
    """The mask of ``paged_decode_reference``: [S, 1, 1, num_tokens], True where a sequence's query
    (at position ``seq_lens - 1``) sees a gathered token; it also hides the padding of short tables."""
    k_pos = torch.arange(num_tokens, device=seq_lens.device).expand(seq_lens.shape[0], num_tokens)
    return attention_mask((seq_lens - 1)[:, None], k_pos, sliding_window)


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           sliding_window: int | None = None, mask: torch.Tensor | None = None,
                           workspace: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One query token per sequence, at position ``seq_lens - 1``, over its cached tokens.

    q: [S, Hq, D]; block_tables: [S, M] (padding entries may be any valid block id);
    seq_lens: [S] tokens cached per sequence, including the query's own -> [S, Hq, D].
    ``mask``: ``decode_mask(seq_lens, M * block_size, sliding_window)`` when the caller already has
    it (the paged cache builds it once per step and window, not once per layer); ``workspace``: two
    buffers for the gathered K and V (``gather_blocks``' ``out``).
    """
    k_out, v_out = workspace or (None, None)
    keys = dequantize_kv(gather_blocks(k_cache, block_tables, k_out), q.dtype, k_scale)  # [S, L, Hkv, D]
    values = dequantize_kv(gather_blocks(v_cache, block_tables, v_out), q.dtype, v_scale)
    if mask is None:
        mask = decode_mask(seq_lens, keys.shape[1], sliding_window)  # [S, 1, 1, L]
    S, Hkv = q.shape[0], keys.shape[2]
    # GQA without copying K/V per query head: fold each KV head's query group into the query axis.
    qg = q.reshape(S, Hkv, -1, q.shape[-1])  # [S, Hkv, G, D]
    out = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask)
    return out.reshape(*q.shape[:-1], values.shape[-1])  # V's width may differ from q's (MLA)


def paged_prefill_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                            q_positions: torch.Tensor, context_len: int, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """A chunk of one sequence's queries over its first ``context_len`` cached tokens.

    q: [Hq, Tq, D]; block_ids: [M]; q_positions: [Tq] -> [Hq, Tq, D].
    """
    keys = dequantize_kv(gather_blocks(k_cache, block_ids[None])[0, :context_len], q.dtype, k_scale)  # [L, Hkv, D]
    values = dequantize_kv(gather_blocks(v_cache, block_ids[None])[0, :context_len], q.dtype, v_scale)
    k_pos = torch.arange(context_len, device=q.device)
    mask = attention_mask(q_positions[None], k_pos[None], sliding_window)  # [1, 1, Tq, L]
    # enable_gqa: each KV head serves its group of query heads without a copy, and the 4-d layout
    # takes the CPU's flash kernel (3.6x faster than the math path at 512 tokens, 9 query heads).
    out = F.scaled_dot_product_attention(q[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                         attn_mask=mask, enable_gqa=True)
    return out[0]
