"""The FP8 KV cache in the decoder graphs (``compiler/formats/fp8_kv.py``: the model's
``Attention.kv_quant``), lowered exactly: new K (after the rotary embedding) and V are rounded
through the FP8 grid with the artifact's scales before they reach the cache, so the caches hold the
values an FP8 cache would, in the graph's dtype. Both attention emitters (``attention.py``) call it.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
from onnx import TensorProto

from backends.onnx.ops import ONNX_DTYPES, GraphBuilder
from compiler.errors import ConfigError
from compiler.formats.kv_quant import INT8_MAX, INT8_MIN, Fp8KVQuant, Int8KVQuant
from compiler.model.transformer import Transformer
from compiler.quant.fp8 import FP8_DTYPES, fp8_max

# Each FP8 format's grid: mantissa bits and the exponent of its smallest normal number.
FP8_GRIDS = {"float8_e4m3fn": (3, -6), "float8_e5m2": (2, -14)}


def fp8_round_trip(b: GraphBuilder, x: str, scale: torch.Tensor, dtype_name: str, name: str, scope: str,
                   head_axis: int = 1) -> str:
    """x [B, H, T, D] (heads on ``head_axis`` of 4; [B, T, H, D]: 2) -> dequantize(quantize(x, scale))
    exactly as ``Fp8KVQuant`` computes it: in float32, x / scale saturated to the format's range,
    rounded to nearest-even on the FP8 grid, times scale; ``scale`` [H] or [1] becomes the initializer ``name``.

    The grid step of |y| is 2^(e - mantissa bits) with e = floor(log2 |y|) (at least the smallest
    normal exponent: subnormals share its step); e is counted as the number of binade bounds
    2^(emin+1) .. 2^emax that |y| reaches, so every value is exact (no Log, no Pow), and y / step
    is exact, so Round (half to even) rounds as the cast to FP8 does. Only standard opset-17 ops."""
    if dtype_name not in FP8_GRIDS:
        raise ConfigError(f"the ONNX lowering has no grid for the KV-cache dtype {dtype_name!r}; "
                          f"it lowers {', '.join(FP8_GRIDS)}")
    mantissa, emin = FP8_GRIDS[dtype_name]
    fmax = fp8_max(FP8_DTYPES[dtype_name])
    emax = int(np.floor(np.log2(fmax)))
    f32 = np.float32
    h = b.op("Cast", [x], scope, to=TensorProto.FLOAT) if b.dtype != "float32" else x
    shape = [1, 1, 1, 1]
    shape[head_axis] = -1
    s = b.weight(name, scale.detach().float().reshape(shape).cpu().numpy(), f32)
    y = b.op("Clip", [b.op("Div", [h, s], scope), b.const(-fmax, scope, f32), b.const(fmax, scope, f32)], scope)
    bounds = b.const([2.0 ** e for e in range(emin + 1, emax + 1)], scope, f32)
    reached = b.op("GreaterOrEqual", [b.op("Unsqueeze", [b.op("Abs", [y], scope), b.const([-1], scope)], scope), bounds], scope)
    binade = b.op("ReduceSum", [b.op("Cast", [reached], scope, to=TensorProto.INT64), b.const([-1], scope)], scope, keepdims=0)
    step = b.op("Gather", [b.const([2.0 ** (e - mantissa) for e in range(emin, emax + 1)], scope, f32), binade], scope, axis=0)
    out = b.op("Mul", [b.op("Mul", [b.op("Round", [b.op("Div", [y, step], scope)], scope), step], scope), s], scope)
    return b.op("Cast", [out], scope, to=ONNX_DTYPES[b.dtype]) if b.dtype != "float32" else out


def int8_round_trip(b: GraphBuilder, x: str, scale: torch.Tensor, reciprocal: torch.Tensor, heads: int, name: str,
                    scope: str, head_axis: int = 1) -> str:
    """x [B, H, T, D] (heads on ``head_axis`` of 4; [B, T, H, D]: 2) -> ``Int8KVQuant``'s rounding op for
    op, in float32: Cast(Clip(Round(x * reciprocal), -128, 127), int8) back to float, times scale (Round is
    half to even, as torch.round); ``scale`` / ``reciprocal`` [H * D] become the initializers ``name`` and
    ``name``.reciprocal. Only standard opset-17 ops."""
    f32 = np.float32
    shape = [1, 1, 1, -1]
    shape[head_axis] = heads
    s = b.weight(name, scale.detach().float().reshape(shape).cpu().numpy(), f32)
    r = b.weight(f"{name}.reciprocal", reciprocal.detach().float().reshape(shape).cpu().numpy(), f32)
    h = b.op("Cast", [x], scope, to=TensorProto.FLOAT) if b.dtype != "float32" else x
    clipped = b.op("Clip", [b.op("Round", [b.op("Mul", [h, r], scope)], scope), b.const(float(INT8_MIN), scope, f32),
                            b.const(float(INT8_MAX), scope, f32)], scope)
    codes = b.op("Cast", [b.op("Cast", [clipped], scope, to=TensorProto.INT8)], scope, to=TensorProto.FLOAT)
    out = b.op("Mul", [codes, s], scope)
    return b.op("Cast", [out], scope, to=ONNX_DTYPES[b.dtype]) if b.dtype != "float32" else out


def kv_rounding(b: GraphBuilder, attn: nn.Module, k: str, v: str, scope: str, head_axis: int = 1) -> tuple[str, str]:
    """K and V (4-d, heads on ``head_axis``) as the layer's ``kv_quant`` hands them to its cache (unchanged without one)."""
    quant = attn.kv_quant
    if quant is None:
        return k, v
    if isinstance(quant, Int8KVQuant):
        heads = attn.config.n_kv_heads
        return (int8_round_trip(b, k, quant.k_scale, quant.k_reciprocal, heads, f"{scope}.k_scale", scope, head_axis),
                int8_round_trip(b, v, quant.v_scale, quant.v_reciprocal, heads, f"{scope}.v_scale", scope, head_axis))
    if not isinstance(quant, Fp8KVQuant):
        raise ConfigError(f"{scope}: K/V hook {type(quant).__name__} is not one the ONNX lowering knows "
                          "(it lowers the FP8 and INT8 KV caches, Fp8KVQuant and Int8KVQuant)")
    return (fp8_round_trip(b, k, quant.k_scale, quant.dtype_name, f"{scope}.k_scale", scope, head_axis),
            fp8_round_trip(b, v, quant.v_scale, quant.dtype_name, f"{scope}.v_scale", scope, head_axis))


def kv_cache_export(model: Transformer) -> str | None:
    """How the graphs hold K/V when the model rounds them through FP8 or INT8 (None: the graph's dtype)."""
    quant = model.layers[0].self_attn.kv_quant if len(model.layers) else None
    if isinstance(quant, Int8KVQuant):
        kind, granularity = "int8", "per-channel"
    elif isinstance(quant, Fp8KVQuant):
        kind, granularity = quant.dtype_name, "per-head" if quant.k_scale.numel() > 1 else "per-tensor"
    else:
        return None
    return f"K/V rounded through {kind} ({granularity} scales) in the graph, held in the graph's dtype"
