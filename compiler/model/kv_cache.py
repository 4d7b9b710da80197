"""The KV-cache interface the model's attention talks to, and the contiguous cache.

Attention hands each layer's new keys and values to the cache and gets the attention output
back, so a cache decides both where K/V live and how they are read: the contiguous cache below
(calibration, reference generation) and the paged cache in ``serving/`` plug in the same way.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F


LatentExpand = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class KVCache(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Store k, v for ``positions`` and return attention of q over everything cached.

        q: [B, Hq, T, D]; k, v: [B, Hkv, T, D]; positions: [B, T] absolute positions -> [B, Hq, T, D].
        """
        ...

    def attend_latent(self, layer_idx: int, q: torch.Tensor, latent: torch.Tensor, positions: torch.Tensor,
                      expand: LatentExpand) -> torch.Tensor:
        """MLA (``compiler/model/mla.py``): store one latent vector per token, and return attention
        of q over K, V that ``expand`` makes of everything cached.

        q: [B, H, T, Dk]; latent: [B, 1, T, Dl]; expand: [B, 1, L, Dl] -> (k [B, H, L, Dk],
        v [B, H, L, Dv]) -> [B, H, T, Dv].
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

    ``sliding_window``: one window for every layer, or one per layer (None: full attention).
    ``keys_only``: MLA's latent cache, one [B, 1, max_len, D] buffer per layer and no V."""

    def __init__(self, n_layers: int, batch_size: int, max_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 sliding_window: int | Sequence[int | None] | None = None, keys_only: bool = False):
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [] if keys_only else [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_len = max_len
        self.sliding_windows = layer_windows(sliding_window, n_layers)
        self.length = 0  # highest position written + 1

    def attend(self, layer_idx, q, k, v, positions):
        self._store(self.k[layer_idx], k, positions)
        self._store(self.v[layer_idx], v, positions)
        k_pos = torch.arange(self.length, device=q.device).expand(q.shape[0], -1)
        mask = attention_mask(positions, k_pos, self.sliding_windows[layer_idx])
        keys = self.k[layer_idx][:, :, : self.length].to(q.dtype)
        values = self.v[layer_idx][:, :, : self.length].to(q.dtype)
        return sdpa(q, keys, values, mask)

    def _store(self, cache: torch.Tensor, x: torch.Tensor, positions: torch.Tensor) -> None:
        if int(positions.max()) >= self.max_len:
            raise ValueError(f"position {int(positions.max())} is past the cache's max_len={self.max_len}")
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        cache[rows, :, positions] = x.transpose(1, 2).to(cache.dtype)  # x: [B, H, T, D] -> index [B, T]
        self.length = max(self.length, int(positions.max()) + 1)

    def attend_latent(self, layer_idx, q, latent, positions, expand):
        self._store(self.k[layer_idx], latent, positions)
        k_pos = torch.arange(self.length, device=q.device).expand(q.shape[0], -1)
        mask = attention_mask(positions, k_pos, self.sliding_windows[layer_idx])
        keys, values = expand(self.k[layer_idx][:, :, : self.length].to(q.dtype))
        return sdpa(q, keys, values, mask)
