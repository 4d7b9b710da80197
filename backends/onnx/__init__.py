"""ONNX export (prefill + decode graphs, KV cache as explicit I/O) and the ``onnx`` target."""
from dataclasses import dataclass

from compiler.deploy.targets import LowerResult, Target, register_target
from compiler.options import option

# MatMulNBits takes any power-of-two block size >= 16; our INT4 format uses 32..256.
MATMULNBITS_BLOCK_SIZES = (16, 32, 64, 128, 256)


def _check(module: str, fmt: dict) -> str | None:
    if fmt.get("format") == "int4" and fmt.get("group_size") not in MATMULNBITS_BLOCK_SIZES:
        return f"int4 group size {fmt.get('group_size')} is not a MatMulNBits block size {MATMULNBITS_BLOCK_SIZES}"
    return None  # float layers export as float; other quantized formats as their dequantized weight


@dataclass(frozen=True)
class OnnxLowerOptions:
    max_len: int | None = option(None, "KV-cache length of the graphs; default min(1024, the model's).")
    # MatMulNBits' accuracy_level (backends/onnx/graph.py): 4, int8 compute, by default; 0 computes
    # in the model's float type (matches torch's dequantize reference to float rounding).
    accuracy_level: int | None = option(None, "MatMulNBits accuracy_level: 0 the model's float type, 4 int8 compute "
                                              "(default 4).")
    fused_rotary: bool = option(True, "Rotary embeddings as com.microsoft RotaryEmbedding or inside "
                                      "GroupQueryAttention (ONNX Runtime); --no-fused-rotary: standard ONNX ops.")
    fused_attention: bool = option(True, "Attention as com.microsoft GroupQueryAttention, a length per batch row, so "
                                         "the ONNX Runtime adapter batches concurrent requests; --no-fused-attention: "
                                         "standard ONNX ops, one length for the batch (requests served one at a time).")

    def __post_init__(self):
        from backends.onnx.graph import MATMULNBITS_ACCURACY_LEVELS

        if self.accuracy_level is not None and self.accuracy_level not in MATMULNBITS_ACCURACY_LEVELS:
            raise ValueError(f"accuracy_level must be one of {MATMULNBITS_ACCURACY_LEVELS} (0 the model's float type, "
                             f"4 int8), got {self.accuracy_level}")


def _lower(artifact, out, opts: OnnxLowerOptions, force: bool) -> LowerResult:
    from backends.onnx.export import OnnxExportOptions, default_dtype, export_onnx, layer_counts
    from backends.onnx.graph import DEFAULT_ACCURACY_LEVEL
    from compiler.deploy.lowering import load_for_target

    loaded, max_len = load_for_target(artifact, "onnx", opts.max_len)
    level = DEFAULT_ACCURACY_LEVEL if opts.accuracy_level is None else opts.accuracy_level
    export = OnnxExportOptions(max_len=max_len, dtype=default_dtype(loaded.model), accuracy_level=level,
                               fused_rotary=opts.fused_rotary, fused_attention=opts.fused_attention)
    return LowerResult(out, layers=layer_counts(export_onnx(loaded, out, export, force)))


register_target(Target("onnx", "ONNX Runtime (INT4 as com.microsoft MatMulNBits, others float)", _check, _lower,
                       OnnxLowerOptions))
