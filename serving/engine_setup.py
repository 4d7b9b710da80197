"""Build the paged KV cache an engine needs from the serving plan and the artifact's KV-cache entry.

An FP8 artifact declares (written by the fp8 pass)::

    manifest["kv_cache"] = {"dtype": "float8_e4m3fn", "granularity": "per_tensor" | "per_head",
                            "k_scale": [per layer: float, or a list with one float per KV head],
                            "v_scale": [...]}
"""
from __future__ import annotations

import torch

from compiler.errors import ArtifactError
from compiler.serving_plan import KV_DTYPES, ServingPlan, bytes_per_block
from serving.paged_cache import KVCacheSpec, PagedKVCache


def _layer_scales(entry: dict, key: str, n_layers: int, n_kv_heads: int) -> list[torch.Tensor]:
    scales = entry.get(key)
    if not isinstance(scales, list) or len(scales) != n_layers:
        raise ArtifactError(f"manifest kv_cache.{key} must list one scale per layer ({n_layers}); recompile the artifact")
    out = []
    for i, s in enumerate(scales):
        t = torch.tensor(s, dtype=torch.float32).reshape(-1)
        if t.numel() not in (1, n_kv_heads) or not bool(torch.isfinite(t).all() and (t > 0).all()):
            raise ArtifactError(f"manifest kv_cache.{key}[{i}] must be a positive float or {n_kv_heads} of them; recompile the artifact")
        out.append(t[:, None])  # [1 or Hkv, 1]: broadcasts over [Hkv, D]
    return out


def resolve_kv_dtype(plan: ServingPlan, model_dtype: torch.dtype, kv_cache: dict | None) -> torch.dtype:
    name = plan.kv_dtype
    if name == "auto":
        name = kv_cache["dtype"] if kv_cache else str(model_dtype).removeprefix("torch.")
    if name not in KV_DTYPES:
        raise ArtifactError(f"KV-cache dtype {name!r} is not supported; use one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[name]


def build_kv_cache(model: torch.nn.Module, plan: ServingPlan, device: torch.device, kv_cache: dict | None) -> PagedKVCache:
    c = model.config
    dtype = resolve_kv_dtype(plan, model.embed_tokens.weight.dtype, kv_cache)
    k_scales = v_scales = None
    if dtype == torch.float8_e4m3fn:
        if not kv_cache:
            raise ArtifactError("an FP8 KV cache needs calibrated K/V scales in manifest['kv_cache']; run the fp8 pass")
        k_scales = _layer_scales(kv_cache, "k_scale", c.n_layers, c.n_kv_heads)
        v_scales = _layer_scales(kv_cache, "v_scale", c.n_layers, c.n_kv_heads)
    num_blocks = plan.num_blocks or max(1, int(plan.kv_memory_mb * 2**20) // bytes_per_block(
        plan.block_size, c.n_layers, c.n_kv_heads, c.head_dim, dtype))
    spec = KVCacheSpec(c.n_layers, num_blocks, plan.block_size, c.n_kv_heads, c.head_dim, dtype)
    return PagedKVCache(spec, device, k_scales, v_scales, c.sliding_window)
