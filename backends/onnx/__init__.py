"""ONNX export (prefill + decode graphs, KV cache as explicit I/O) and the ``onnx`` target."""
from compiler.targets import TargetSpec, register_target

# MatMulNBits takes any power-of-two block size >= 16; our INT4 format uses 32..256.
MATMULNBITS_BLOCK_SIZES = (16, 32, 64, 128, 256)


def _check(module: str, fmt: dict) -> str | None:
    if fmt.get("format") == "int4" and fmt.get("group_size") not in MATMULNBITS_BLOCK_SIZES:
        return f"int4 group size {fmt.get('group_size')} is not a MatMulNBits block size {MATMULNBITS_BLOCK_SIZES}"
    return None  # float layers export as float; other quantized formats as their dequantized weight


register_target(TargetSpec("onnx", "ONNX Runtime (INT4 as com.microsoft MatMulNBits, others float)", _check))
