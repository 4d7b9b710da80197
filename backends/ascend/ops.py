"""Which ONNX operators ATC compiles: the table, and the check that runs before anything else.

The table is CANN 8.0's "supported ONNX operators" list (ONNX 1.12-level support; opset ranges
per operator, capped at 17 since ATC reads ONNX 1.12 models). Contrib domains (com.microsoft:
``MatMulNBits`` …) and the standard ``QuantizeLinear``/``DequantizeLinear``, ``Loop`` and ``Scan``
are not on it: quantization on Ascend goes through Ascend-specific ops or msModelSlim weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx

from compiler.errors import ConfigError

MAX_OPSET = 17
_DEFAULT_RANGE = (8, MAX_OPSET)
# Operators whose support starts later than opset 8 (the opset that introduced them or the
# first version ATC parses); everything else in the list below uses _DEFAULT_RANGE.
_FIRST_OPSET = {"Range": 11, "GreaterOrEqual": 12, "LessOrEqual": 12, "Trilu": 14, "LayerNormalization": 17,
                "Einsum": 12, "GatherND": 11, "ScatterND": 11, "ScatterElements": 11, "GatherElements": 11,
                "NonZero": 9, "Where": 9, "Mod": 10, "CumSum": 11, "Round": 11, "Det": 11, "Celu": 12,
                "HardSwish": 14, "BitShift": 11, "Shrink": 9, "OneHot": 9, "Erf": 9, "Sign": 9,
                "ConstantOfShape": 9, "EyeLike": 9, "Compress": 9, "TfIdfVectorizer": 9, "Resize": 10,
                "RoiAlign": 10, "ReverseSequence": 10, "NonMaxSuppression": 10, "ThresholdedRelu": 10,
                "SoftmaxCrossEntropyLoss": 12, "BitwiseAnd": 18, "BitwiseOr": 18, "BitwiseXor": 18, "BitwiseNot": 18}
ATC_ONNX_OPS = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization BitShift Cast Ceil
Celu Clip Compress Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DepthToSpace Det Div
Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor GRU Gather GatherElements GatherND Gemm
GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual HardSigmoid Hardmax HardSwish Identity If
InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax LpNormalization
LpPool LRN LSTM MatMul Max MaxPool MaxRoiPool MaxUnpool Mean MeanVarianceNormalization Min Mod Mul
Multinomial Neg NonMaxSuppression NonZero Not OneHot Or Pad Pow PRelu RandomNormal RandomNormalLike
RandomUniform RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax
ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RoiAlign Round
Scatter ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax
SoftmaxCrossEntropyLoss Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh TfIdfVectorizer
ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Where Xor
""".split())

WAYS_OUT = {
    "MatMulNBits": "lower with --target ascend, which exports INT4 layers as fp16 MatMul of the dequantized "
                   "weights and writes the INT4 weights in msModelSlim W4A16 layout for MindIE / vllm-ascend",
    "DequantizeLinear": "fold the QDQ pair into float weights before export (quantize for Ascend with AMCT or msModelSlim)",
    "QuantizeLinear": "fold the QDQ pair into float weights before export (quantize for Ascend with AMCT or msModelSlim)",
    "GroupQueryAttention": "lower with --target ascend, whose graphs write attention in standard ops (or --target "
                           "onnx with --no-fused-attention for another runtime)",
    "RotaryEmbedding": "lower with --target ascend, whose graphs write the rotary embedding in standard ops (or "
                       "--target onnx with --no-fused-rotary for another runtime)",
    "Loop": "unroll the loop into a static graph (fixed trip count) or run it on the host",
    "Scan": "unroll the scan into a static graph or run it on the host",
}
DEFAULT_WAY_OUT = "replace it with operators from ATC's supported list, or provide it as an Ascend C custom operator"


@dataclass(frozen=True)
class OpOffense:
    """One node ATC cannot compile, and what to do about it."""

    graph: str
    node: str
    op_type: str
    domain: str
    opset: int
    reason: str
    way_out: str

    def __str__(self) -> str:
        domain = self.domain or "ai.onnx"
        return f"{self.graph}: node {self.node!r} ({self.op_type}, {domain} opset {self.opset}) {self.reason}; {self.way_out}"


def supported_range(op_type: str) -> tuple[int, int] | None:
    if op_type not in ATC_ONNX_OPS:
        return None
    return _FIRST_OPSET.get(op_type, _DEFAULT_RANGE[0]), MAX_OPSET


def check_ops(model: onnx.ModelProto, graph_name: str = "model") -> list[OpOffense]:
    """Every node of ``model`` (including nested subgraphs) that ATC cannot compile."""
    opsets = {o.domain: o.version for o in model.opset_import}
    return _check_graph(model.graph, opsets, graph_name)


def _check_graph(graph: onnx.GraphProto, opsets: dict[str, int], graph_name: str) -> list[OpOffense]:
    offenses = []
    for node in graph.node:
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        opset = opsets.get(node.domain, opsets.get("", 0))
        name = node.name or f"<unnamed {node.op_type}>"
        way_out = WAYS_OUT.get(node.op_type, DEFAULT_WAY_OUT)
        span = supported_range(node.op_type) if not domain else None
        if span is None:
            where = f"custom domain {domain!r}" if domain else "ATC's ONNX operator list"
            offenses.append(OpOffense(graph_name, name, node.op_type, domain, opset, f"is not in {where}", way_out))
        elif not span[0] <= opset <= span[1]:
            offenses.append(OpOffense(graph_name, name, node.op_type, domain, opset,
                                      f"is supported at opset {span[0]}..{span[1]} only",
                                      f"re-export the model at opset {min(max(opset, span[0]), span[1])}"))
        for attr in node.attribute:  # If/Loop bodies are checked too
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                offenses += _check_graph(sub, opsets, f"{graph_name}/{name}")
    return offenses


def require_supported(models: dict[str, onnx.ModelProto]) -> None:
    """Raise one ConfigError naming every offending node (name, op, opset, way out)."""
    offenses = [o for name, m in models.items() for o in check_ops(m, name)]
    if offenses:
        shown = "; ".join(str(o) for o in offenses[:5])
        more = f" (+{len(offenses) - 5} more)" if len(offenses) > 5 else ""
        raise ConfigError(f"ATC cannot compile {len(offenses)} node(s): {shown}{more}")
