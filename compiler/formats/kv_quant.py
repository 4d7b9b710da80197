"""Quantized KV caches: the manifest entry, and the attention hook that makes a model see their K/V.

The ``fp8`` pass (FP8) or the ``int8`` pass (INT8) calibrates K/V scales and records them in the
artifact manifest:

    "kv_cache": {"dtype": "float8_e4m3fn" | "float8_e5m2", "granularity": "per_tensor" | "per_head",
                 "k_scale": [per layer: float (per_tensor) or [one per kv head] (per_head)],
                 "v_scale": [...]}
    "kv_cache": {"dtype": "int8", "granularity": "per_channel",
                 "k_scale": [per layer: [n_kv_heads * head_dim floats, head-major]], "v_scale": [...]}

FP8: K/V ≈ saturate(K / scale).to(dtype) * scale. INT8 (vllm-ascend's "C8" cache, symmetric):
codes = clamp(round(K * (1 / scale)), -128, 127), K/V ≈ codes * scale, per channel, in float32.
K is taken after the rotary embedding (what a cache holds). So that evaluation and the reference
paths measure the same model, a loaded artifact installs ``Fp8KVQuant`` or ``Int8KVQuant`` as
``Attention.kv_quant``: it rounds K and V before they reach any cache or the cache-less attention.
The engine's paged cache stores the codes themselves (FP8 E4M3 per KV head, or INT8 per channel
through ``int8_codes``, 1 byte a value) and dequantizes them on read, the same K/V the hook gives,
so the engine drops the hook (``serving/engine_setup.py``). A cache of another dtype keeps it and
stores the rounded values: the same K/V, without the memory saving.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from compiler.errors import ArtifactError, ConfigError
from compiler.quant.fp8 import FP8_DTYPES, dequantize, quantize, scale_from_amax

INT8 = "int8"
INT8_MIN, INT8_MAX = -128, 127  # vllm-ascend's clamp (a symmetric scale maps the calibrated abs-max to 127)
GRANULARITIES = {**{name: ("per_tensor", "per_head") for name in FP8_DTYPES}, INT8: ("per_channel",)}


def _per_head(scale: torch.Tensor) -> torch.Tensor:
    return scale.reshape(1, -1, 1, 1)  # broadcast over [B, Hkv, T, D]


class Fp8KVQuant(nn.Module):
    """``(k, v) -> (k, v)`` rounded through FP8; scales [Hkv] or [1] (not saved: the manifest holds them)."""

    def __init__(self, dtype: str, k_scale: torch.Tensor, v_scale: torch.Tensor):
        super().__init__()
        self.dtype_name = dtype
        self.register_buffer("k_scale", k_scale.float(), persistent=False)
        self.register_buffer("v_scale", v_scale.float(), persistent=False)

    def forward(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = FP8_DTYPES[self.dtype_name]
        ks, vs = _per_head(self.k_scale), _per_head(self.v_scale)
        return dequantize(quantize(k, ks, dtype), ks, k.dtype), dequantize(quantize(v, vs, dtype), vs, v.dtype)


def int8_codes(x: torch.Tensor, reciprocal: torch.Tensor) -> torch.Tensor:
    """vllm-ascend's ``_quantize_kv_to_int8``: x * (1 / scale) in float32, offset 0, rounded half to
    even, clamped to [-128, 127]; ``reciprocal`` broadcasts over x (per channel)."""
    return torch.round(x.float() * reciprocal).clamp(INT8_MIN, INT8_MAX).to(torch.int8)


def int8_round_trip(x: torch.Tensor, scale: torch.Tensor, reciprocal: torch.Tensor) -> torch.Tensor:
    """x [B, Hkv, T, D] through int8 codes with per-channel ``scale`` [Hkv * D] (``reciprocal`` = 1 / scale):
    ``int8_codes``, then vllm-ascend's ``_dequant_paged_kv_to_dense`` (codes * scale), in float32."""
    shape = (1, x.shape[1], 1, x.shape[3])
    return (int8_codes(x, reciprocal.reshape(shape)).float() * scale.reshape(shape)).to(x.dtype)


class Int8KVQuant(nn.Module):
    """``(k, v) -> (k, v)`` rounded through INT8 per channel; scales [Hkv * D] (not saved: the manifest holds them)."""

    def __init__(self, k_scale: torch.Tensor, v_scale: torch.Tensor):
        super().__init__()
        for name, scale in (("k", k_scale), ("v", v_scale)):
            self.register_buffer(f"{name}_scale", scale.float(), persistent=False)
            self.register_buffer(f"{name}_reciprocal", 1 / scale.float(), persistent=False)  # as vllm-ascend divides

    def forward(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return int8_round_trip(k, self.k_scale, self.k_reciprocal), int8_round_trip(v, self.v_scale, self.v_reciprocal)


class KVObserver(nn.Module):
    """Calibration stand-in for the KV rounding: records each channel's K and V abs-max [Hkv, D], passes K/V through."""

    def __init__(self):
        super().__init__()
        self.k_amax: torch.Tensor | None = None
        self.v_amax: torch.Tensor | None = None

    def forward(self, k, v):
        k_amax, v_amax = k.detach().abs().float().amax(dim=(0, 2)), v.detach().abs().float().amax(dim=(0, 2))
        self.k_amax = k_amax if self.k_amax is None else torch.maximum(self.k_amax, k_amax)
        self.v_amax = v_amax if self.v_amax is None else torch.maximum(self.v_amax, v_amax)
        return k, v


def int8_kv_scales(amax: torch.Tensor) -> torch.Tensor:
    """Per-channel scales from abs-maxima: amax / 127 rounded up onto bfloat16's grid (8 significant
    bits), so that vllm-ascend, which holds them in the model dtype (bfloat16 or float16), holds the
    artifact's own; rounding up keeps the calibrated range inside ±127. A channel calibration never
    saw away from 0 gets 1 (any scale holds 0)."""
    scale = torch.where(amax > 0, amax.float() / INT8_MAX, torch.ones_like(amax, dtype=torch.float32))
    bits = scale.view(torch.int32)
    return ((bits + 0xFFFF) & -0x10000).view(torch.float32)  # clear the 16 low mantissa bits, rounding up


def kv_cache_entry(dtype: str, granularity: str, observers: list[KVObserver]) -> dict:
    """The manifest's ``kv_cache`` entry from calibrated observers (one per layer)."""
    for i, o in enumerate(observers):
        if not bool(torch.isfinite(o.k_amax).all() and torch.isfinite(o.v_amax).all()):
            raise ConfigError(f"layer {i}'s K/V are not finite on the calibration windows, so no KV-cache scale "
                              "holds them; compile in float32, or without kv_cache_dtype")
    if dtype == INT8:
        def scales(amax: torch.Tensor):
            return int8_kv_scales(amax).flatten().tolist()
    else:
        def scales(amax: torch.Tensor):
            per_head = amax.amax(-1)
            if granularity == "per_tensor":
                return scale_from_amax(per_head.amax(), FP8_DTYPES[dtype]).item()
            return scale_from_amax(per_head, FP8_DTYPES[dtype]).tolist()

    return {"dtype": dtype, "granularity": granularity,
            "k_scale": [scales(o.k_amax) for o in observers], "v_scale": [scales(o.v_amax) for o in observers]}


def parse_kv_scales(entry: dict, config) -> tuple[str, torch.Tensor, torch.Tensor]:
    """Validate a manifest ``kv_cache`` entry: (dtype name, k_scale [L, C], v_scale [L, C]), C = 1 (per_tensor),
    n_kv_heads (per_head) or n_kv_heads * head_dim (per_channel)."""
    dtype, granularity = entry.get("dtype"), entry.get("granularity")
    if granularity not in GRANULARITIES.get(dtype, ()):
        raise ArtifactError(f"kv_cache entry has dtype {dtype!r}, granularity {granularity!r}; expected an FP8 dtype "
                            "per_tensor or per_head, or int8 per_channel; recompile the artifact")
    columns = {"per_tensor": 1, "per_head": config.n_kv_heads,
               "per_channel": config.n_kv_heads * config.head_dim}[granularity]
    tensors = []
    for key in ("k_scale", "v_scale"):
        try:
            t = torch.tensor(entry.get(key, []), dtype=torch.float32).reshape(len(entry.get(key, [])), -1)
        except (TypeError, ValueError, RuntimeError):
            t = torch.empty(0)
        if t.shape != (config.n_layers, columns) or not bool((t > 0).all() and torch.isfinite(t).all()):
            raise ArtifactError(f"kv_cache {key} must hold {config.n_layers} layers × {columns} positive scales, "
                                f"got {entry.get(key)!r:.60}; recompile the artifact")
        tensors.append(t)
    return dtype, tensors[0], tensors[1]


def install_kv_quant(model: nn.Module, entry: dict) -> None:
    """Give every attention layer of ``model`` the K/V rounding the manifest entry describes."""
    dtype, k_scale, v_scale = parse_kv_scales(entry, model.config)
    for i, layer in enumerate(model.layers):
        quant = Int8KVQuant(k_scale[i], v_scale[i]) if dtype == INT8 else Fp8KVQuant(dtype, k_scale[i], v_scale[i])
        layer.self_attn.kv_quant = quant
