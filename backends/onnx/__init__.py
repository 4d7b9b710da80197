"""ONNX export (prefill + decode graphs, KV cache as explicit I/O) and the ``onnx`` target."""
from dataclasses import dataclass

from compiler.deploy.lowering import register_lowering
from compiler.deploy.targets import TargetSpec, register_target
from compiler.options import option

# MatMulNBits takes any power-of-two block size >= 16; our INT4 format uses 32..256.
MATMULNBITS_BLOCK_SIZES = (16, 32, 64, 128, 256)


def _check(module: str, fmt: dict) -> str | None:
    if fmt.get("format") == "int4" and fmt.get("group_size") not in MATMULNBITS_BLOCK_SIZES:
        return f"int4 group size {fmt.get('group_size')} is not a MatMulNBits block size {MATMULNBITS_BLOCK_SIZES}"
    return None  # float layers export as float; other quantized formats as their dequantized weight


register_target(TargetSpec("onnx", "ONNX Runtime (INT4 as com.microsoft MatMulNBits, others float)", _check))


@dataclass(frozen=True)
class OnnxLowerOptions:
    max_len: int | None = option(None, "KV-cache length of the graphs; default min(1024, the model's).")


def _lower(artifact, out, opts: OnnxLowerOptions, force: bool):
    from backends.onnx.export import OnnxExportOptions, default_dtype, export_onnx
    from compiler.deploy.lowering import load_for_target

    loaded, max_len = load_for_target(artifact, "onnx", opts.max_len)
    export_onnx(loaded, out, OnnxExportOptions(max_len=max_len, dtype=default_dtype(loaded.model)), force)
    return out


register_lowering("onnx", _lower, OnnxLowerOptions)
