"""FP8 KV cache: the manifest entry, and the attention hook that makes a model see FP8 K/V.

The ``fp8`` pass calibrates K/V scales and records them in the artifact manifest; the serving
engine's paged cache stores K/V in FP8 with exactly these scales:

    "kv_cache": {"dtype": "float8_e4m3fn", "granularity": "per_tensor" | "per_head",
                 "k_scale": [per layer: float (per_tensor) or [one per kv head] (per_head)],
                 "v_scale": [...]}

K/V ≈ saturate(K / scale).to(dtype) * scale, with K taken after the rotary embedding (what a
cache holds). So that evaluation and the reference paths measure the same model, a loaded
artifact installs ``Fp8KVQuant`` as ``Attention.kv_quant``: it rounds K and V through FP8 before
they reach any cache or the cache-less attention. Rounding twice with one scale changes
nothing, so an engine cache that quantizes again stores the same codes.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from compiler.errors import ArtifactError
from compiler.quant.fp8 import FP8_DTYPES, dequantize, quantize, scale_from_amax


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


class KVObserver(nn.Module):
    """Calibration stand-in for ``Fp8KVQuant``: records each head's K and V abs-max, passes K/V through."""

    def __init__(self):
        super().__init__()
        self.k_amax: torch.Tensor | None = None
        self.v_amax: torch.Tensor | None = None

    def forward(self, k, v):
        k_amax, v_amax = k.detach().abs().float().amax(dim=(0, 2, 3)), v.detach().abs().float().amax(dim=(0, 2, 3))
        self.k_amax = k_amax if self.k_amax is None else torch.maximum(self.k_amax, k_amax)
        self.v_amax = v_amax if self.v_amax is None else torch.maximum(self.v_amax, v_amax)
        return k, v


def kv_cache_entry(dtype: str, granularity: str, observers: list[KVObserver]) -> dict:
    """The manifest's ``kv_cache`` entry from calibrated observers (one per layer)."""
    fp8 = FP8_DTYPES[dtype]

    def scales(amax: torch.Tensor):
        if granularity == "per_tensor":
            return scale_from_amax(amax.amax(), fp8).item()
        return scale_from_amax(amax, fp8).tolist()

    return {"dtype": dtype, "granularity": granularity,
            "k_scale": [scales(o.k_amax) for o in observers], "v_scale": [scales(o.v_amax) for o in observers]}


def parse_kv_scales(entry: dict, config) -> tuple[str, torch.Tensor, torch.Tensor]:
    """Validate a manifest ``kv_cache`` entry: (dtype name, k_scale [L, H], v_scale [L, H]), H = 1 or n_kv_heads."""
    dtype = entry.get("dtype")
    if dtype not in FP8_DTYPES or entry.get("granularity") not in ("per_tensor", "per_head"):
        raise ArtifactError(f"kv_cache entry has dtype {dtype!r}, granularity {entry.get('granularity')!r}; "
                            "expected an FP8 dtype and per_tensor or per_head; recompile the artifact")
    heads = 1 if entry["granularity"] == "per_tensor" else config.n_kv_heads
    tensors = []
    for key in ("k_scale", "v_scale"):
        try:
            t = torch.tensor(entry.get(key, []), dtype=torch.float32).reshape(len(entry.get(key, [])), -1)
        except (TypeError, ValueError, RuntimeError):
            t = torch.empty(0)
        if t.shape != (config.n_layers, heads) or not bool((t > 0).all() and torch.isfinite(t).all()):
            raise ArtifactError(f"kv_cache {key} must hold {config.n_layers} layers × {heads} positive scales, "
                                f"got {entry.get(key)!r:.60}; recompile the artifact")
        tensors.append(t)
    return dtype, tensors[0], tensors[1]


def install_kv_quant(model: nn.Module, entry: dict) -> None:
    """Give every attention layer of ``model`` the FP8 K/V rounding the manifest entry describes."""
    dtype, k_scale, v_scale = parse_kv_scales(entry, model.config)
    for i, layer in enumerate(model.layers):
        layer.self_attn.kv_quant = Fp8KVQuant(dtype, k_scale[i], v_scale[i])
