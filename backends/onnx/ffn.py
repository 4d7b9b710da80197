"""The feed-forward blocks of the decoder graph: the gated MLP (SwiGLU / GeGLU) and the routed
experts of Qwen3-MoE and Mixtral (``compiler/model/moe.py``'s ``SparseMoE``).

The experts are lowered densely: every expert runs on every token and the outputs are summed
with each token's routing weight for that expert, zero for the experts its top-k did not pick.
That is the same function as routing (x + 0 adds nothing, so the sum over the picked experts in
ascending order is what ``run_experts`` adds up), in standard ops with static shapes (ATC's list
too), but it costs num_experts / num_experts_per_tok times the routed compute, and every step
reads every expert's weights: 4x for Mixtral-8x7B (top-2 of 8), 16x for Qwen3-30B-A3B (top-8 of
128). Fine for small MoE models and for checking a lowering; a large MoE wants routed execution
(a per-expert gather/scatter with data-dependent shapes, or ONNX Runtime's com.microsoft MoE
contrib op), which this export does not do yet. Two ways it could part from routing, neither
seen: an unpicked expert whose output overflows gives 0 * inf = NaN, and TopK breaks exact ties
of router probabilities by the lower index where torch.topk does not promise an order.
"""
from __future__ import annotations

import numpy as np
import torch.nn as nn
from onnx import TensorProto, numpy_helper

from backends.onnx.ops import ONNX_DTYPES, GraphBuilder, activation, linear
from compiler.model.moe import MixtralExpert, SparseMoE


def feed_forward(b: GraphBuilder, x: str, ffn: nn.Module, act: str, scope: str, dequantize: bool) -> str:
    """A layer's feed-forward (``DecoderLayer.ffn``): an ``MLP`` or a ``SparseMoE``. x [B, T, dim]."""
    if isinstance(ffn, SparseMoE):
        return sparse_moe(b, x, ffn, act, scope, dequantize)
    return gated_mlp(b, x, ffn, act, scope, dequantize)


def gated_mlp(b: GraphBuilder, x: str, mlp: nn.Module, act: str, scope: str, dequantize: bool) -> str:
    """down(act(gate(x)) * up(x)) of an ``MLP`` or a ``MixtralExpert``; weights named after its modules."""
    if isinstance(mlp, MixtralExpert):
        names = ("w1", "w3", "w2")
    else:
        names = ("gate_proj", "up_proj", "down_proj")
    g, u, d = (getattr(mlp, n) for n in names)
    h = activation(b, linear(b, x, g, f"{scope}.{names[0]}", dequantize), act, scope)
    return linear(b, b.op("Mul", [h, linear(b, x, u, f"{scope}.{names[1]}", dequantize)], scope), d,
                  f"{scope}.{names[2]}", dequantize)


def routing_weights(b: GraphBuilder, x: str, moe: SparseMoE, scope: str, dequantize: bool) -> str:
    """[B, T, num_experts]: each token's weight for every expert, as ``SparseMoE.route`` picks them
    (softmax of the router logits in float32, top-k, renormalised when ``norm_topk_prob``), zero
    for the experts not picked. Float32, or the graph's dtype where the model casts them back (Qwen3-MoE)."""
    logits = linear(b, x, moe.gate, f"{scope}.gate", dequantize)
    if b.dtype != "float32":
        logits = b.op("Cast", [logits], scope, to=TensorProto.FLOAT)
    probs = b.op("Softmax", [logits], scope, axis=-1)
    top, ids = b.op("TopK", [probs, b.const([moe.top_k], scope)], scope, n_out=2, axis=-1, largest=1, sorted=1)
    if moe.normalize:
        top = b.op("Div", [top, b.op("ReduceSum", [top, b.const([-1], scope)], scope, keepdims=1)], scope)
    zeros = b.op("ConstantOfShape", [b.op("Shape", [probs], scope)], scope,
                 value=numpy_helper.from_array(np.zeros(1, np.float32), "value"))
    weights = b.op("ScatterElements", [zeros, ids, top], scope, axis=-1)
    if moe.weights_in_model_dtype and b.dtype != "float32":
        weights = b.op("Cast", [weights], scope, to=ONNX_DTYPES[b.dtype])
    return weights


def sparse_moe(b: GraphBuilder, x: str, moe: SparseMoE, act: str, scope: str, dequantize: bool) -> str:
    """Sum over experts e of weight[..., e] * expert_e(x), every expert on every token (see the module
    docstring for the cost). Each term is computed in the weights' dtype and cast back, as ``run_experts``."""
    weights = routing_weights(b, x, moe, scope, dequantize)
    f32_weights = not moe.weights_in_model_dtype and b.dtype != "float32"
    out = None
    for e, expert in enumerate(moe.experts):
        es = f"{scope}.experts.{e}"
        y = gated_mlp(b, x, expert, act, es, dequantize)
        w = b.op("Slice", [weights, b.const([e], es), b.const([e + 1], es), b.const([-1], es)], es)  # [B, T, 1]
        if f32_weights:  # Mixtral at float16: y * fp32 weight in fp32, then back to the model's dtype
            term = b.op("Cast", [b.op("Mul", [b.op("Cast", [y], es, to=TensorProto.FLOAT), w], es)], es,
                        to=ONNX_DTYPES[b.dtype])
        else:
            term = b.op("Mul", [y, w], es)
        out = term if out is None else b.op("Add", [out, term], es)
    return out

