"""Model preparation: everything the engine does to a model before serving it, in one place
(``prepare_model``), which says what it did in a ``LoadReport``.

In order: move it to the device; fuse q/k/v and gate/up (``compiler/model/fusion.py``); pack the
CPU's float32 weights (``compiler/kernels/dense_cpu.py``); put INT4 layers on the plan's compute
(``set_int4_compute``); build the paged KV cache from the KV-cache plan (``plan_kv_cache``: the
one the paged_kv pass recorded, or the same function's for a plan given here); drop the model's
K/V rounding hook where a quantized cache stores the same codes; report the kernels the forward
runs (``kernel_report``).

An FP8 or INT8 artifact declares (written by the fp8 or int8 pass; ``compiler/formats/kv_quant.py``)::

    manifest["kv_cache"] = {"dtype": "float8_e4m3fn", "granularity": "per_tensor" | "per_head",
                            "k_scale": [per layer: float, or a list with one float per KV head],
                            "v_scale": [...]}
    manifest["kv_cache"] = {"dtype": "int8", "granularity": "per_channel",
                            "k_scale": [per layer: [n_kv_heads * head_dim floats]], "v_scale": [...]}

and the cache stores FP8 E4M3 or int8 codes (1 byte a value) with those scales. Under a float
``kv_dtype`` (or for an E5M2 entry) the cache holds floats, and the model's ``kv_quant`` hook
rounds K/V first (``compiler.deploy.serving_plan.resolve_kv_dtype``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compiler.deploy.serving_plan import KV_DTYPES, SCALED_KV_DTYPES, KVCachePlan, ServingPlan, plan_kv_cache
from compiler.errors import ArtifactError, ConfigError
from compiler.formats.fp8 import Fp8Linear
from compiler.formats.int4 import Int4Linear
from compiler.formats.kv_quant import Int8KVQuant, parse_kv_scales
from compiler.kernels import w4a8_cpu
from compiler.kernels.cpu_ext import cpu_isa_in_use, cpu_kernels_status
from compiler.kernels.dense_cpu import pack_linears
from compiler.kernels.dispatch import fp8_kernel, int4_kernel, resolve_int4_compute
from compiler.model.fusion import fuse_projections
from serving.paged_cache import KVCacheSpec, PagedKVCache


@dataclass
class LoadReport:
    """What ``prepare_model`` did to the model, step by step."""

    fusion: dict  # {"fused": [attention / MLP modules], why-not: [modules]}; {} when the plan fuses nothing
    packing: dict  # {"packed": [linear layers], "kernel": what they run}; {} off the CPU or when not asked
    int4: dict  # ``set_int4_compute``'s report; {} for a model without INT4 layers
    kv_cache: KVCachePlan  # the cache built: dtype, blocks, block size
    kv_rounding_dropped: bool  # the K/V rounding hook removed (an FP8 or INT8 cache stores the same codes)
    kernels: dict  # ``kernel_report``: what the forward runs, layer kind by kind


def prepare_model(model: torch.nn.Module, plan: ServingPlan, device: torch.device,
                  kv_cache_entry: dict | None) -> tuple[PagedKVCache, LoadReport]:
    """Make ``model`` (changed in place) ready for the engine on ``device``; its paged KV cache and
    what was done. Fusion before packing and INT4 compute, so that the fused projections are the
    layers packed."""
    model.to(device).eval()
    fusion = fuse_projections(model) if plan.fuse_projections else {}
    packing = pack_linears(model) if plan.pack_cpu_weights and device.type == "cpu" else {}
    int4 = set_int4_compute(model, plan.int4_compute, device)
    model_dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    kv = plan_kv_cache(plan, model.config, model_dtype, kv_cache_entry)
    cache = build_kv_cache(model, kv, device, kv_cache_entry)
    dropped = cache.k_scales is not None  # an FP8 or INT8 cache with the artifact's scales
    if dropped:
        drop_kv_rounding(model)
    # Otherwise a KV-cache hook stays: it rounds K/V before the model-dtype cache stores them.
    kernels = kernel_report(model, device, packing, decode_attention(cache), cache.spec.dtype)
    return cache, LoadReport(fusion, packing, int4, kv, dropped, kernels)


def build_kv_cache(model: torch.nn.Module, kv: KVCachePlan, device: torch.device, kv_cache: dict | None) -> PagedKVCache:
    """The paged cache of plan ``kv``; an FP8 or INT8 one with the artifact's K/V scales."""
    c = model.config
    dtype = KV_DTYPES[kv.kv_dtype]
    k_scales = v_scales = None
    heads, dim, values = c.kv_cache_layout
    if kv.kv_dtype in SCALED_KV_DTYPES:
        if not values:
            raise ArtifactError(f"a {kv.kv_dtype} KV cache is not supported for {c.architecture}'s latent (MLA) "
                                "cache; serve it with kv_dtype = \"auto\"")
        _, k, v = parse_kv_scales(kv_cache, c)
        shape = (heads, dim) if dtype == torch.int8 else (-1, 1)  # per channel, or [1 or Hkv, 1] broadcast over D
        k_scales, v_scales = [s.reshape(shape) for s in k], [s.reshape(shape) for s in v]
    spec = KVCacheSpec(c.n_layers, kv.num_blocks, kv.block_size, heads, dim, dtype, keys_only=not values)
    return PagedKVCache(spec, device, k_scales, v_scales, c.sliding_windows)


def drop_kv_rounding(model: torch.nn.Module) -> None:
    """Remove the K/V rounding hook (``Fp8KVQuant`` or ``Int8KVQuant``) a quantized-KV artifact installs
    in each attention layer: a paged cache of that dtype with the same scales stores the same codes
    without it (it quantizes as the hook does), and it costs a dozen small ops per layer and step."""
    for layer in model.layers:
        layer.self_attn.kv_quant = None


def decode_attention(cache: PagedKVCache) -> str:
    """The decode-attention kernel ``cache`` runs ("triton", "cpu [ISA level]", or "torch" with why)."""
    isa = f" [{cpu_isa_in_use()}]" if cache.decode_kernel == "cpu" else ""
    return cache.decode_kernel + isa + (f" ({cache.decode_kernel_note})" if cache.decode_kernel_note else "")


def set_int4_compute(model: torch.nn.Module, compute: str, device: torch.device) -> dict:
    """Put every ``Int4Linear`` of ``model`` on the plan's ``int4_compute`` (``resolve_int4_compute``)
    and pack the W4A8 copies now (a one-time cost at load). ``{"compute", "asked", "layers", "kernel",
    "w4a16": {layer: why}}`` for a model with INT4 layers, else {}. W4A8 asked for by name where it
    cannot run at all is a ConfigError: the plan asked for those numerics, so they are not silently
    replaced by others; "auto" says in ``why`` what it chose instead."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    if not layers:
        return {}
    asked = compute
    compute, why_not_w4a8 = resolve_int4_compute(compute, device)
    if compute == "w4a16":
        for layer in layers.values():
            layer.use_w4a8(False)
        return {"compute": compute, "asked": asked, "layers": len(layers), **({"why": why_not_w4a8} if why_not_w4a8 else {})}
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
    return {"compute": compute, "asked": asked, "layers": len(layers) - len(kept), "kernel": w4a8_cpu.KERNEL,
            "w4a16": kept}


# A prefill's tokens for the report: past every row threshold of the dispatch (INT4's is 256).
REPORT_PREFILL_TOKENS = 512


def kernel_report(model: torch.nn.Module, device: torch.device, packing: dict, decode_attention: str,
                  cache_dtype: torch.dtype) -> dict:
    """What the engine's forward runs, as a float32 decode step (one token a sequence) and a prefill
    would: ``{"cpu": kernels' status and ISA level, "linear": float linears' kernel, "int4" / "fp8":
    {"decode": {kernel: layers}, "prefill": {...}}, "attention": decode attention's kernel}``, and
    ``"kv_cache"`` for a cache of FP8 or int8 codes, or where the model's own hook rounds K/V before
    a cache of another dtype stores them;
    the ISA level of every qcompile C++ kernel named beside it (``compiler/kernels/dispatch.py``)."""
    report = {"cpu": cpu_kernels_status() if device.type == "cpu" else None, "isa": cpu_isa_in_use(),
              "linear": packing.get("kernel", "F.linear (not packed)"), "attention": decode_attention}
    quant = model.layers[0].self_attn.kv_quant if len(model.layers) else None
    cache = str(cache_dtype).removeprefix("torch.")
    if quant is not None:
        name = "int8" if isinstance(quant, Int8KVQuant) else quant.dtype_name
        report["kv_cache"] = (f"{name} K/V rounded by the model's kv_quant hook, stored in {cache} blocks "
                              "(no memory saving)")
    elif cache in SCALED_KV_DTYPES:
        report["kv_cache"] = f"{cache} codes with the artifact's scales, dequantized on read"
    choosers = ((Int4Linear, "int4", int4_kernel), (Fp8Linear, "fp8", fp8_kernel))
    with torch.no_grad():
        for module in model.modules():
            for cls, name, choose in choosers:
                if isinstance(module, cls):
                    entry = report.setdefault(name, {"decode": {}, "prefill": {}})
                    for phase, tokens in (("decode", 1), ("prefill", REPORT_PREFILL_TOKENS)):
                        x = torch.empty(tokens, module.in_features, device=device)
                        kernel = choose(module, x).describe()
                        entry[phase][kernel] = entry[phase].get(kernel, 0) + 1
    return report


def describe_kernels(report: dict) -> str:
    """``kernel_report`` in one line, for a log: 'ISA avx2 · linear dense_linear [avx2] · int4 decode ...'."""
    parts = [f"ISA {report['isa'] or 'none (' + str(report['cpu']) + ')'}", f"linear {report['linear']}"]
    for name in ("int4", "fp8"):
        for phase, kernels in report.get(name, {}).items():
            parts.append(f"{name} {phase} " + ", ".join(f"{k} ×{n}" for k, n in kernels.items()))
    parts.append(f"attention {report['attention']}")
    if "kv_cache" in report:
        parts.append(f"KV cache {report['kv_cache']}")
    return " · ".join(parts)
