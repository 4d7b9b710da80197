"""The KV-cache interface the model's attention talks to, and the contiguous cache.

Attention hands each layer's new keys and values to the cache and gets the attention output
back, so a cache decides both where K/V live and how they are read: the contiguous cache below
(calibration, reference generation) and the paged cache in ``serving/`` plug in the same way.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.nn.functional as F


class KVCache(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Store k, v for ``positions`` and return attention of q over everything cached.

        q: [B, Hq, T, D]; k, v: [B, Hkv, T, D]; positions: [B, T] absolute positions -> [B, Hq, T, D].
        """
        ...


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Boolean mask [B, 1, Tq, Tk]: a query sees keys at or before its position (within the window)."""
    diff = q_pos[:, None, :, None] - k_pos[:, None, None, :]
    mask = diff >= 0
    if sliding_window is not None:
        mask &= diff < sliding_window
    return mask


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads (k/v heads shared by q-head groups)."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)


def layer_windows(sliding_window: int | Sequence[int | None] | None, n_layers: int) -> list[int | None]:
    """Per-layer attention windows from one window for every layer (or None) or a list of them."""
    if sliding_window is None or isinstance(sliding_window, int):
        return [sliding_window] * n_layers
    windows = list(sliding_window)
    if len(windows) != n_layers:
        raise ValueError(f"{len(windows)} sliding windows for {n_layers} layers")
    return windows


class ContiguousKVCache:
    """One [B, Hkv, max_len, D] buffer per layer for K and for V; positions index it directly.

    ``sliding_window``: one window for every layer, or one per layer (None: full attention)."""

    def __init__(self, n_layers: int, batch_size: int, max_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 sliding_window: int | Sequence[int | None] | None = None):
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len = max_len
        self.sliding_windows = layer_windows(sliding_window, n_layers)
        self.length = 0  # highest position written + 1

    def attend(self, layer_idx, q, k, v, positions):
        if int(positions.max()) >= self.max_len:
            raise ValueError(f"position {int(positions.max())} is past the cache's max_len={self.max_len}")
        rows = torch.arange(q.shape[0], device=q.device)[:, None]
        # k: [B, H, T, D] -> index [B, T] into the position axis
        self.k[layer_idx][rows, :, positions] = k.transpose(1, 2).to(self.k[layer_idx].dtype)
        self.v[layer_idx][rows, :, positions] = v.transpose(1, 2).to(self.v[layer_idx].dtype)
        self.length = max(self.length, int(positions.max()) + 1)
        k_pos = torch.arange(self.length, device=q.device).expand(q.shape[0], -1)
        mask = attention_mask(positions, k_pos, self.sliding_windows[layer_idx])
        keys = self.k[layer_idx][:, :, : self.length].to(q.dtype)
        values = self.v[layer_idx][:, :, : self.length].to(q.dtype)
        return sdpa(q, keys, values, mask)
