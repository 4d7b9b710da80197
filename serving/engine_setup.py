"""Build the paged KV cache an engine needs from the serving plan and the artifact's KV-cache entry.

An FP8 artifact declares (written by the fp8 pass)::

    manifest["kv_cache"] = {"dtype": "float8_e4m3fn", "granularity": "per_tensor" | "per_head",
                            "k_scale": [per layer: float, or a list with one float per KV head],
                            "v_scale": [...]}
"""
from __future__ import annotations

import torch

from compiler.deploy.serving_plan import KV_DTYPES, ServingPlan, bytes_per_block
from compiler.errors import ArtifactError
from compiler.formats.fp8_kv import parse_kv_scales
from serving.paged_cache import KVCacheSpec, PagedKVCache


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
    heads, dim, values = c.kv_cache_layout
    if dtype == torch.float8_e4m3fn:
        if not values:
            raise ArtifactError(f"an FP8 KV cache is not supported for {c.architecture}'s latent (MLA) cache; "
                                "serve it with kv_dtype = \"auto\"")
        if not kv_cache:
            raise ArtifactError("an FP8 KV cache needs calibrated K/V scales in manifest['kv_cache']; run the fp8 pass")
        _, k, v = parse_kv_scales(kv_cache, c)
        k_scales, v_scales = list(k[:, :, None]), list(v[:, :, None])  # per layer [1 or Hkv, 1]: broadcasts over [Hkv, D]
    num_blocks = plan.num_blocks or max(1, int(plan.kv_memory_mb * 2**20) // bytes_per_block(
        plan.block_size, c.n_layers, heads, dim, dtype, values))
    spec = KVCacheSpec(c.n_layers, num_blocks, plan.block_size, heads, dim, dtype, keys_only=not values)
    return PagedKVCache(spec, device, k_scales, v_scales, c.sliding_windows)
