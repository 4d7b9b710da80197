"""The paged KV cache the model's attention talks to (``compiler.model.kv_cache.KVCache``).

The engine runs the model on one flattened batch ``[1, total_tokens]`` holding, per scheduled
sequence, its next tokens (one for a decode, a chunk for a prefill) with their absolute
positions. Before the forward it hands the cache the batch's ``BatchMetadata``; each layer's
``attend`` then writes the new K/V through the slot mapping and attends every sequence over its
own blocks: decodes together (the Triton kernel on CUDA, the C++ kernel of
``compiler/kernels/cpu_ext.py`` on the CPU, the torch reference where neither is had or for an
int8 cache on CUDA), prefill chunks one sequence at a time. All K/V are written before any are
read, so a sequence may read blocks another sequence fills in the same step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from compiler.deploy.serving_plan import bytes_per_block
from compiler.kernels import triton_available
from compiler.kernels.cpu_ext import cpu_kernels, cpu_kernels_status, paged_decode_cpu
from compiler.model.kv_cache import layer_windows
from serving.paged_attention import (
    decode_mask,
    paged_decode_reference,
    paged_prefill_reference,
    quantize_kv,
)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape and storage type of the paged cache."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    keys_only: bool = False  # MLA: one latent vector per token (K's tensor), no V

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.block_size, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                               values=not self.keys_only)

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


@dataclass
class PrefillSeq:
    q_start: int  # index of the chunk's first token in the flattened batch
    q_len: int
    context_len: int  # tokens cached after this step, the chunk included
    block_ids: torch.Tensor  # [M]


@dataclass
class BatchMetadata:
    """Where a step's tokens go and what each sequence reads."""

    slot_mapping: torch.Tensor  # [T] cache slot of each batch token
    decode_token_idx: torch.Tensor  # [Sd] batch index of each decode sequence's token, ascending
    decode_block_tables: torch.Tensor  # [Sd, M] block ids, padded with 0
    decode_seq_lens: torch.Tensor  # [Sd]
    prefills: list[PrefillSeq] = field(default_factory=list)


DECODE_KERNELS = ("triton", "cpu", "torch")  # PagedKVCache's decode attention: CUDA, the C++ kernel, the reference


class PagedKVCache:
    """Per layer ``[num_blocks, block_size, Hkv, D]`` K and V tensors, read and written through metadata.

    They hold ``spec.dtype``: the model's dtype, or codes with per-layer scales, 1 byte a value:
    FP8 E4M3 with ``k_scales`` / ``v_scales`` ``[Hkv, 1]`` or ``[1, 1]``, or int8 with ``[Hkv, D]``
    (per channel). ``attend`` quantizes what it writes (``quantize_kv``) and every read dequantizes.

    ``sliding_window``: one window for every layer, or one per layer (None: full attention). A
    windowed layer still keeps every block; it only reads the last ``window`` positions."""

    def __init__(self, spec: KVCacheSpec, device: torch.device | str = "cpu", k_scales: list[torch.Tensor] | None = None,
                 v_scales: list[torch.Tensor] | None = None, sliding_window: int | Sequence[int | None] | None = None,
                 decode_kernel: str | None = None):
        self.spec = spec
        self.device = torch.device(device)
        shape = (spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.k = [torch.zeros(shape, dtype=spec.dtype, device=self.device) for _ in range(spec.num_layers)]
        self.v = [] if spec.keys_only else [torch.zeros(shape, dtype=spec.dtype, device=self.device)
                                            for _ in range(spec.num_layers)]
        self.k_scales = [s.to(self.device) for s in k_scales] if k_scales else None  # per layer, as above
        self.v_scales = [s.to(self.device) for s in v_scales] if v_scales else None
        if spec.dtype in (torch.float8_e4m3fn, torch.int8) and not (self.k_scales and self.v_scales):
            raise ValueError(f"a {str(spec.dtype).removeprefix('torch.')} KV cache needs per-layer k_scales and "
                             "v_scales")
        self.sliding_windows = layer_windows(sliding_window, spec.num_layers)
        # "triton" (CUDA), "cpu" (the C++ kernel) or "torch" (the reference); decode_kernel_note says why
        if decode_kernel not in (None, *DECODE_KERNELS):
            raise ValueError(f"decode_kernel {decode_kernel!r}: one of {', '.join(DECODE_KERNELS)}")
        if decode_kernel == "triton" and spec.dtype == torch.int8:
            raise ValueError("the Triton decode kernel reads no int8 cache (per-channel scales); use \"torch\"")
        self.decode_kernel, self.decode_kernel_note = decode_kernel or self._default_decode_kernel(), ""
        if self.decode_kernel == "torch" and decode_kernel is None:
            self.decode_kernel_note = (f"C++ CPU kernels {cpu_kernels_status()}" if self.device.type != "cuda"
                                       else "the Triton kernel reads no int8 cache" if spec.dtype == torch.int8
                                       else "no Triton on this CUDA device")
        self.meta: BatchMetadata | None = None
        # The torch decode path's per-step state, the same for every layer: masks per window, and the
        # buffers K and V are gathered into (reused by every layer and step rather than allocated per call).
        self._decode_masks: dict[int | None, torch.Tensor] = {}
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self._workspace_numel = 0

    def _default_decode_kernel(self) -> str:
        if self.device.type == "cuda" and triton_available() and self.spec.dtype != torch.int8:
            return "triton"
        if self.device.type == "cpu" and cpu_kernels() is not None:
            return "cpu"
        return "torch"

    def set_batch(self, meta: BatchMetadata) -> None:
        self.meta = meta
        self._decode_masks = {}
        if self.decode_kernel == "torch":
            numel = meta.decode_block_tables.numel() * self.spec.block_size * self.spec.num_kv_heads * self.spec.head_dim
            if self._workspace is None or self._workspace[0].numel() < numel:  # grown, never shrunk
                self._workspace = tuple(torch.empty(numel, dtype=self.spec.dtype, device=self.device) for _ in range(2))
            self._workspace_numel = numel

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``src``'s K/V into ``dst`` in every layer."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in (*self.k, *self.v):
            cache[dst] = cache[src]

    def _scales(self, layer_idx: int):
        if self.k_scales is None:
            return None, None
        return self.k_scales[layer_idx], self.v_scales[layer_idx]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """q: [1, Hq, T, D]; k, v: [1, Hkv, T, D]; positions: [1, T] -> [1, Hq, T, D]."""
        meta = self.meta
        if meta is None or q.shape[0] != 1:
            raise RuntimeError("PagedKVCache.attend needs set_batch() and a flattened [1, T] batch")
        k_scale, v_scale = self._scales(layer_idx)
        window = self.sliding_windows[layer_idx]
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        H, D = self.spec.num_kv_heads, self.spec.head_dim
        kc.view(-1, H, D)[meta.slot_mapping] = quantize_kv(k[0].transpose(0, 1), kc.dtype, k_scale)
        vc.view(-1, H, D)[meta.slot_mapping] = quantize_kv(v[0].transpose(0, 1), vc.dtype, v_scale)
        q_tok = q[0].transpose(0, 1)  # [T, Hq, D]
        if not meta.prefills and meta.decode_token_idx.shape[0] == q_tok.shape[0]:
            # decodes only, the steady state: token i is decode i (the indices ascend), no gather or scatter
            return self._decode(layer_idx, q_tok, kc, vc, window).transpose(0, 1)[None]
        out = torch.empty_like(q_tok)
        if meta.decode_token_idx.numel():
            out[meta.decode_token_idx] = self._decode(layer_idx, q_tok[meta.decode_token_idx], kc, vc, window)
        pos = positions[0]
        for p in meta.prefills:
            sl = slice(p.q_start, p.q_start + p.q_len)
            o = paged_prefill_reference(q_tok[sl].transpose(0, 1), kc, vc, p.block_ids, pos[sl], p.context_len,
                                        k_scale, v_scale, window)
            out[sl] = o.transpose(0, 1)
        return out.transpose(0, 1)[None]

    def _decode(self, layer_idx: int, qd: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                window: int | None) -> torch.Tensor:
        """The decode sequences' attention: qd [Sd, Hq, D] -> [Sd, Hq, D]."""
        meta = self.meta
        k_scale, v_scale = self._scales(layer_idx)
        if self.decode_kernel == "triton":
            from compiler.kernels.paged_decode import paged_decode_triton

            return paged_decode_triton(qd, kc, vc, meta.decode_block_tables, meta.decode_seq_lens, k_scale, v_scale,
                                       window)
        if self.decode_kernel == "cpu":
            return paged_decode_cpu(qd, kc, vc, meta.decode_block_tables, meta.decode_seq_lens, k_scale, v_scale, window)
        return paged_decode_reference(qd, kc, vc, meta.decode_block_tables, meta.decode_seq_lens, k_scale, v_scale,
                                      window, self._decode_mask(window), self._step_workspace())

    def _step_workspace(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of this step's size on the gather buffers."""
        numel = self._workspace_numel
        return self._workspace[0][:numel], self._workspace[1][:numel]

    def _decode_mask(self, window: int | None) -> torch.Tensor:
        """The decode mask of this step for ``window``: the same for every layer, so built once."""
        mask = self._decode_masks.get(window)
        if mask is None:
            meta = self.meta
            num_tokens = meta.decode_block_tables.shape[1] * self.spec.block_size
            mask = self._decode_masks[window] = decode_mask(meta.decode_seq_lens, num_tokens, window)
        return mask

    def attend_latent(self, layer_idx: int, q: torch.Tensor, latent: torch.Tensor, positions: torch.Tensor,
                      expand) -> torch.Tensor:
        """MLA: q [1, H, T, Dk]; latent [1, 1, T, Dl]; expand as ``KVCache.attend_latent`` -> [1, H, T, Dv].

        The latent is written through the slot mapping like K; each read expands the blocks a
        sequence reads into K/V blocks and attends over them with the torch reference (no Triton
        kernel for MLA yet). Every decode sequence expands all of its table's blocks, padding
        included (masked); a sequence's result does not depend on what else is in the batch."""
        meta = self.meta
        if meta is None or q.shape[0] != 1 or not self.spec.keys_only:
            raise RuntimeError("PagedKVCache.attend_latent needs a keys-only (MLA) cache, set_batch() and a [1, T] batch")
        cache = self.k[layer_idx]
        cache.view(-1, 1, self.spec.head_dim)[meta.slot_mapping] = latent[0].transpose(0, 1).to(cache.dtype)
        window = self.sliding_windows[layer_idx]
        q_tok = q[0].transpose(0, 1)  # [T, H, Dk]
        parts: list[tuple[torch.Tensor | slice, torch.Tensor]] = []
        if meta.decode_token_idx.numel():
            tables = meta.decode_block_tables
            k, v = _expand_blocks(cache, tables.flatten(), expand, q.dtype)
            local = torch.arange(tables.numel(), device=tables.device).view(tables.shape)
            parts.append((meta.decode_token_idx, paged_decode_reference(
                q_tok[meta.decode_token_idx], k, v, local, meta.decode_seq_lens, None, None, window)))
        pos = positions[0]
        for p in meta.prefills:
            sl = slice(p.q_start, p.q_start + p.q_len)
            k, v = _expand_blocks(cache, p.block_ids, expand, q.dtype)
            local = torch.arange(len(p.block_ids), device=p.block_ids.device)
            o = paged_prefill_reference(q_tok[sl].transpose(0, 1), k, v, local, pos[sl], p.context_len,
                                        None, None, window)
            parts.append((sl, o.transpose(0, 1)))
        out = q_tok.new_empty(q_tok.shape[0], q_tok.shape[1], parts[0][1].shape[-1])  # [T, H, Dv]
        for where, o in parts:
            out[where] = o
        return out.transpose(0, 1)[None]


def _expand_blocks(cache: torch.Tensor, block_ids: torch.Tensor, expand, dtype: torch.dtype):
    """The latent blocks ``block_ids`` [M] of ``cache`` [N, bs, 1, Dl] as K and V blocks
    [M, bs, H, Dk], [M, bs, H, Dv] (block i of the result is block ``block_ids[i]``)."""
    M, bs = block_ids.numel(), cache.shape[1]
    latent = cache[block_ids].to(dtype).reshape(1, 1, M * bs, cache.shape[-1])
    k, v = expand(latent)  # [1, H, M * bs, D]
    return (k[0].transpose(0, 1).reshape(M, bs, k.shape[1], -1),
            v[0].transpose(0, 1).reshape(M, bs, v.shape[1], -1))
