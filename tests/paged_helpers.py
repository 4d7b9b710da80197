"""Paged K/V for the attention tests: random sequences scattered into randomly placed cache blocks."""
from __future__ import annotations

import torch

# The decode kernels against the reference, per device: float32 sums in both; the GPU's tl.exp is an
# approximate exp2 (a few ulp), hence the looser bound there. The C++ kernel computes in float32
# whatever the cache's dtype: the CPU's bound.
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


@torch.no_grad()
def int8_kv_entry(model: torch.nn.Module) -> dict:
    """The int8 pass's KV-cache entry, calibrated on ``model``'s K/V over random ids."""
    from compiler.formats.kv_quant import INT8, KVObserver, kv_cache_entry

    observers = [KVObserver() for _ in model.layers]
    for layer, observer in zip(model.layers, observers):
        layer.self_attn.kv_quant = observer
    model(torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5)))
    for layer in model.layers:
        layer.self_attn.kv_quant = None
    return kv_cache_entry(INT8, "per_channel", observers)
