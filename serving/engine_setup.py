"""Build the paged KV cache an engine needs from the serving plan and the artifact's KV-cache entry,
and set how its INT4 layers compute (``set_int4_compute``).

An FP8 artifact declares (written by the fp8 pass)::

    manifest["kv_cache"] = {"dtype": "float8_e4m3fn", "granularity": "per_tensor" | "per_head",
                            "k_scale": [per layer: float, or a list with one float per KV head],
                            "v_scale": [...]}
"""
from __future__ import annotations

import torch

from compiler.deploy.serving_plan import KV_DTYPES, ServingPlan, bytes_per_block
from compiler.errors import ArtifactError, ConfigError
from compiler.formats.fp8_kv import parse_kv_scales
from compiler.formats.int4 import Int4Linear
from compiler.kernels import w4a8_cpu
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


def set_int4_compute(model: torch.nn.Module, compute: str, device: torch.device) -> dict:
    """Put every ``Int4Linear`` of ``model`` on the plan's ``int4_compute`` and pack the W4A8 copies
    now (a one-time cost at load). ``{"compute", "layers", "kernel", "w4a16": {layer: why}}`` for a
    model with INT4 layers, else {}. W4A8 asked where it cannot run at all is a ConfigError: the
    plan asked for those numerics, so they are not silently replaced by others."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    if not layers:
        return {}
    if compute == "w4a16":
        for layer in layers.values():
            layer.use_w4a8(False)
        return {"compute": compute, "layers": len(layers)}
    if device.type != "cpu":
        raise ConfigError(f"int4_compute \"w4a8\" is a CPU kernel; on {device.type} INT4 runs W4A16: serve with "
                          "int4_compute = \"w4a16\"")
    if why := w4a8_cpu.w4a8_unavailable_reason():
        raise ConfigError(f"int4_compute \"w4a8\" cannot run here: {why}; serve with int4_compute = \"w4a16\"")
    kept = {}
    with torch.no_grad():
        for name, layer in layers.items():
            if why := layer.use_w4a8():
                kept[name] = why
            else:
                layer.w4a8_pack()
    return {"compute": compute, "layers": len(layers) - len(kept), "kernel": w4a8_cpu.KERNEL, "w4a16": kept}
