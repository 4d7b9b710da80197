"""The pieces a decoder graph is built from: a builder that collects nodes and weights, and the
layers every architecture shares (Linear, including INT4 as MatMulNBits; RMSNorm; rotary
embedding; the gated feed-forward's activations), each in standard opset-17 ops (ATC's list)
except MatMulNBits.
"""
from __future__ import annotations

import numpy as np
import onnx
import torch
import torch.nn as nn
from onnx import TensorProto, helper, numpy_helper

from compiler.errors import ConfigError
from compiler.formats.int4 import Int4Linear
from compiler.formats.qlinear import QuantizedLinear

OPSET = 17
MS_DOMAIN = "com.microsoft"
NP_DTYPES = {"float32": np.float32, "float16": np.float16}
ONNX_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}

class GraphBuilder:
    """Collects nodes and initializers; weights are kept apart so two graphs can share them."""

    def __init__(self, dtype: str, accuracy_level: int = 0):
        self.dtype = dtype
        self.accuracy_level = accuracy_level  # of every MatMulNBits node
        self.np_dtype = NP_DTYPES[dtype]
        self.nodes: list[onnx.NodeProto] = []
        self.consts: list[onnx.TensorProto] = []
        self.weights: dict[str, onnx.TensorProto] = {}
        self._count = 0

    def op(self, op_type: str, inputs: list[str], scope: str, n_out: int = 1, domain: str = "", **attrs):
        """Add a node named ``{scope}/{op_type}_{k}``; returns its output name(s)."""
        self._count += 1
        name = f"{scope}/{op_type}_{self._count}"
        outputs = [f"{name}:{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs[0] if n_out == 1 else outputs

    def const(self, value, scope: str, dtype=None) -> str:
        """A small graph-specific constant (int64 by default for shapes and indices)."""
        self._count += 1
        name = f"{scope}/const_{self._count}"
        self.consts.append(numpy_helper.from_array(np.asarray(value, dtype=dtype or np.int64), name))
        return name

    def fconst(self, value, scope: str) -> str:
        return self.const(value, scope, self.np_dtype)

    def weight(self, name: str, tensor: torch.Tensor | np.ndarray, dtype=None) -> str:
        if name not in self.weights:
            array = tensor.detach().cpu().numpy() if isinstance(tensor, torch.Tensor) else tensor
            self.weights[name] = numpy_helper.from_array(np.ascontiguousarray(array.astype(dtype or self.np_dtype)), name)
        return name

    def fweight(self, name: str, tensor: torch.Tensor) -> str:
        """A float weight in the graph's dtype (converted through float32)."""
        return self.weight(name, tensor.detach().float().cpu().numpy())


def linear(b: GraphBuilder, x: str, module: nn.Module, name: str, dequantize: bool) -> str:
    """x [B, T, K] -> [B, T, N] for an nn.Linear, Int4Linear (MatMulNBits) or other QuantizedLinear."""
    if isinstance(module, Int4Linear) and not dequantize:
        # The packed buffers already are MatMulNBits' B / scales / zero_points: no re-quantization.
        inputs = [x, b.weight(f"{name}.qweight", module.qweight, np.uint8),
                  b.fweight(f"{name}.scales", module.scales.reshape(-1)),
                  b.weight(f"{name}.qzeros", module.qzeros.reshape(-1), np.uint8)]
        y = b.op("MatMulNBits", inputs, name, domain=MS_DOMAIN, K=module.in_features, N=module.out_features,
                 bits=4, block_size=module.group_size, accuracy_level=b.accuracy_level)
    else:
        w = module.dequantized_weight() if isinstance(module, QuantizedLinear) else module.weight
        y = b.op("MatMul", [x, b.fweight(f"{name}.weight_t", w.t())], name)
    bias = module.dequantized_bias() if isinstance(module, QuantizedLinear) else module.bias
    if bias is not None:
        y = b.op("Add", [y, b.fweight(f"{name}.bias", bias)], name)
    return y


def packed_linear(b: GraphBuilder, x: str, modules: list[nn.Module], name: str, dequantize: bool) -> str | None:
    """x [B, T, K] -> the outputs of ``modules`` side by side, [B, T, sum N], as one MatMulNBits (every
    module INT4 with one group size) or one MatMul (none exported as INT4); None when they mix the
    two. Each output column is computed as ``linear`` computes it alone (columns are independent),
    so packing changes no value; it saves the kernel calls (q/k/v: three per layer become one)."""
    int4 = [isinstance(m, Int4Linear) and not dequantize for m in modules]
    if any(int4) and not (all(int4) and len({(m.group_size, m.in_features) for m in modules}) == 1):
        return None
    if all(int4):
        first = modules[0]
        inputs = [x, b.weight(f"{name}.qweight", torch.cat([m.qweight for m in modules]), np.uint8),
                  b.fweight(f"{name}.scales", torch.cat([m.scales for m in modules]).reshape(-1)),
                  b.weight(f"{name}.qzeros", torch.cat([m.qzeros for m in modules]).reshape(-1), np.uint8)]
        y = b.op("MatMulNBits", inputs, name, domain=MS_DOMAIN, K=first.in_features,
                 N=sum(m.out_features for m in modules), bits=4, block_size=first.group_size,
                 accuracy_level=b.accuracy_level)
    else:
        weights = [m.dequantized_weight() if isinstance(m, QuantizedLinear) else m.weight for m in modules]
        y = b.op("MatMul", [x, b.fweight(f"{name}.weight_t", torch.cat(weights).t())], name)
    biases = [m.dequantized_bias() if isinstance(m, QuantizedLinear) else m.bias for m in modules]
    if any(bias is not None for bias in biases):  # a missing bias adds zeros
        biases = [torch.zeros(m.out_features) if bias is None else bias.detach().float()
                  for m, bias in zip(modules, biases)]
        y = b.op("Add", [y, b.fweight(f"{name}.bias", torch.cat(biases))], name)
    return y


def rms_norm(b: GraphBuilder, x: str, module: nn.Module, name: str) -> str:
    """RMSNorm over the last axis of x, as ``compiler.model.layers.RMSNorm`` computes it: normalised in
    float32, then cast back and times the weight; a norm with a ``weight_offset`` (Gemma's
    ``GemmaRMSNorm``, its weights stored as offsets from 1) times (offset + weight) in float32
    before the cast."""
    h = b.op("Cast", [x], name, to=TensorProto.FLOAT) if b.dtype != "float32" else x
    # Pow -> ReduceMean -> Add -> Sqrt -> Div (-> Mul by the weight) is the pattern ONNX Runtime's
    # optimizer fuses into one SimplifiedLayerNormalization kernel (seven nodes -> one, per norm).
    ms = b.op("ReduceMean", [b.op("Pow", [h, b.const(np.float32(2.0), name, np.float32)], name)], name, axes=[-1], keepdims=1)
    eps = b.const(np.float32(module.eps), name, np.float32)
    h = b.op("Div", [h, b.op("Sqrt", [b.op("Add", [ms, eps], name)], name)], name)
    if module.weight_offset:
        gain = b.weight(f"{name}.offset_weight", (module.weight.detach().float() + module.weight_offset).numpy(), np.float32)
        h = b.op("Mul", [h, gain], name)
        return b.op("Cast", [h], name, to=ONNX_DTYPES[b.dtype]) if b.dtype != "float32" else h
    if b.dtype != "float32":
        h = b.op("Cast", [h], name, to=ONNX_DTYPES[b.dtype])
    return b.op("Mul", [b.fweight(f"{name}.weight", module.weight), h], name)


def rope(b: GraphBuilder, x: str, cos: str, sin: str, half: int, scope: str) -> str:
    """x [B, H, T, D] * cos + rotate_half(x) * sin, with cos/sin [T, D]."""
    axis = b.const([-1], scope)
    x1 = b.op("Slice", [x, b.const([0], scope), b.const([half], scope), axis], scope)
    x2 = b.op("Slice", [x, b.const([half], scope), b.const([2 * half], scope), axis], scope)
    rotated = b.op("Concat", [b.op("Neg", [x2], scope), x1], scope, axis=-1)
    return b.op("Add", [b.op("Mul", [x, cos], scope), b.op("Mul", [rotated, sin], scope)], scope)


def fused_rope(b: GraphBuilder, x: str, cos_half: str, sin_half: str, offset: str, scope: str) -> str:
    """``rope`` as one com.microsoft RotaryEmbedding (rotate-half layout): x [B, H, T, D], half tables
    [L, D / 2] read from position ``offset`` (int64 [1]) on. ONNX Runtime only; ATC has no such op."""
    return b.op("RotaryEmbedding", [x, offset, cos_half, sin_half], scope, domain=MS_DOMAIN, interleaved=0)


def activation(b: GraphBuilder, x: str, kind: str, scope: str) -> str:
    """The gated feed-forward's activation (``ArchSpec.activation``): SiLU, or GELU's tanh
    approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) as torch's
    ``gelu(approximate="tanh")`` (opset 17 has no Gelu; ATC reads no later opset)."""
    if kind == "silu":
        return b.op("Mul", [x, b.op("Sigmoid", [x], scope)], scope)
    if kind != "gelu_tanh":
        raise ConfigError(f"{scope}: the ONNX export has no {kind!r} activation (it lowers silu, gelu_tanh)")
    cube = b.op("Mul", [b.op("Mul", [x, x], scope), x], scope)
    inner = b.op("Add", [x, b.op("Mul", [cube, b.fconst(0.044715, scope)], scope)], scope)
    t = b.op("Tanh", [b.op("Mul", [inner, b.fconst(np.sqrt(2.0 / np.pi), scope)], scope)], scope)
    half_x = b.op("Mul", [x, b.fconst(0.5, scope)], scope)
    return b.op("Mul", [half_x, b.op("Add", [t, b.fconst(1.0, scope)], scope)], scope)
