"""qcompile's C++ CPU kernels (``csrc/cpu_kernels.cpp``): built once, loaded as ``torch.ops.qcompile_cpu``.

    ops = cpu_kernels()            # the op namespace, or None when the kernels cannot be had
    why = cpu_kernels_status()     # "loaded", or why not (no compiler, turned off, ...)

- ``paged_decode(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, window, sm_scale)``:
  the paged cache's decode attention, reading each cached row in place (float32, bfloat16,
  float16 or FP8 E4M3 with its scales); ``serving/paged_attention.py``'s reference gathers every
  sequence's blocks into a buffer first. Same contract, checked against it in tests.
- ``fp8_fake_quant_rows(x, shift, static_scale, dtype)``: ``Fp8Linear``'s activation
  quantization in one op instead of about ten, bit for bit the torch ops of ``compiler/quant/fp8.py``;
  ``fp8_linear(x, shift, static_scale, dtype, weight, bias, packed)``: that, times the dequantized
  float32 weight (or ``packed``, that weight in oneDNN's layout), plus the bias, in one call (a
  float32 model's forward, whose Python path costs more than the rounding at a few tokens).
- ``rms_norm(x, weight, eps, weight_offset)``, ``rope_qk(q, k, cos, sin)``, ``silu_mul(gate, up)``:
  the decoder layer's RMSNorm, rotary embedding and SwiGLU (``compiler/model/layers.py``) in one op
  each, float32; RoPE bit for bit, SwiGLU bit for bit where torch vectorises the whole row (its own
  exp, ``Sleef_expf16_u10``; the fused and separate gate/up both take the op, so they agree
  exactly), the norm within an ulp of its scale (a sum's order). A decode step runs them about a
  hundred times, where each torch op's dispatch costs more than its arithmetic.
  ``cpu_kernels_for(x)`` says whether a forward on x may use them.
- ``fp8_linear_codes(x, shift, static_scale, activation_dtype, packed, weight_dtype, weight_scale,
  out_features, bias)``: ``Fp8Linear``'s forward on its codes (``pack_fp8_codes``' layout), where
  the CPU has AVX512-BF16 (``fp8_codes_gemm_enabled()``): FP8 values are exact in bfloat16 and
  their products in float32, so a bfloat16 dot product multiplies the activation codes by the
  weight codes exactly; the scales are applied to the float32 sums. Within ~2e-7 of the dequantize
  reference (the order of the float32 roundings), 1 byte read per weight instead of the float
  copy's 4, and no float copy kept.
- ``int4_linear(x, weight, group_size, scales_and_zeros, padded_in_features, bias)``:
  ``int4_cpu_matmul``'s casts, padding, torch's INT4 kernel and bias in one call, the same bits.
- ``dense_linear(x, packed, out_features, bias)``: a float32 linear layer on its weight packed in
  blocks of 16 output channels (``compiler/kernels/dense_cpu.py``, where the CPU has AVX-512:
  ``dense_gemm_available()``); the weight read once as a stream, each row's sums in one order
  whatever the batch. Within ~1e-7 of ``F.linear`` (the order of the float32 sums).
  ``int4_dense_linear(x, codes, scales, zeros, group_size, bias)``: an ``Int4Linear``'s many-token
  float32 forward on its own buffers, the dequantize reference's weights built a panel at a time
  for those tiles (``compiler/kernels/int4_cpu.py``).
- ``w4a8_linear(x, packed, scales, zero_scales, group_size, out_features, bias)``: an INT4 layer on
  int8 activations (W4A8: each row quantized per group, integer dot products with AVX512-VNNI,
  ``w4a8_available()``), ``compiler/kernels/w4a8_cpu.py``'s packing; within ~1e-7 of its torch
  reference ``w4a8_reference``.

torch builds the library with its C++ toolchain (``torch.utils.cpp_extension``: a C++ compiler and
``ninja``) into its extensions cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``),
keyed by the source, so a change to the source rebuilds it; ``scripts/setup.sh`` builds it at
install (``python -m compiler.kernels.cpu_ext``), and the first use in a process loads it. Where it
cannot be built the callers run the torch reference and say so in their load report
(``cpu_kernels_status()``), never silently. ``QCOMPILE_CPU_KERNELS=0`` turns the kernels off for a
process, to compare against the reference.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

SWITCH = "QCOMPILE_CPU_KERNELS"
SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
# -O3 -march=native: built on the machine that runs it. -fopenmp: at::parallel_for is inline
# OpenMP in ATen's headers, so without it the kernels run on one thread; its `omp simd` loops
# vectorise without -ffast-math, which would change the FP8 rounding and NaN handling kept exact.
# -ffp-contract=off: GCC would otherwise fuse a * b + c into an FMA, and rope_qk would no longer be
# bit for bit torch's (the attention kernel measured no slower without it).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
LDFLAGS = ["-fopenmp"]


def _build(verbose: bool) -> None:
    """Build the library into torch's extensions cache (or find it there) and load it."""
    from torch.utils import cpp_extension

    cpp_extension.load(name="qcompile_cpu", sources=[str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
                       is_python_module=False, verbose=verbose)


@functools.cache
def _load() -> tuple[object | None, str]:
    if os.environ.get(SWITCH, "1") == "0":
        return None, f"turned off ({SWITCH}=0)"
    try:
        _build(verbose=False)
    except Exception as e:  # no compiler or ninja, a failed build: the callers fall back and report it
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return None, f"not built ({first_line[:200]}); run 'python -m compiler.kernels.cpu_ext' to see the build log"
    return torch.ops.qcompile_cpu, "loaded"


def cpu_kernels():
    """``torch.ops.qcompile_cpu`` (built on first use), or None when it cannot be built or is turned off."""
    return _load()[0]


def cpu_kernels_for(x: torch.Tensor):
    """``cpu_kernels()`` where a layer's forward on ``x`` may run them instead of its torch code: a
    float32 CPU tensor outside autograd (the ops have no backward); else None."""
    if x.dtype is torch.float32 and x.is_cpu and not torch.is_grad_enabled():
        return cpu_kernels()
    return None


CODES_SWITCH = "QCOMPILE_FP8_CPU_CODES"


def fp8_codes_gemm_enabled() -> bool:
    """Whether ``fp8_linear_codes`` can run here: the kernels loaded, built for a CPU with
    AVX512-BF16, and not turned off (``QCOMPILE_FP8_CPU_CODES=0``, to compare with the float copy)."""
    ops = cpu_kernels()
    return ops is not None and os.environ.get(CODES_SWITCH, "1") != "0" and _has_bf16_dot()


@functools.cache
def _has_bf16_dot() -> bool:
    return bool(torch.ops.qcompile_cpu.fp8_codes_gemm_available())


def pack_fp8_codes(weight: torch.Tensor) -> torch.Tensor:
    """FP8 weight codes [N, K] -> ``fp8_linear_codes``' layout, uint8 [ceil(N/16), ceil(K/2), 16, 2]:
    per block of 16 output channels and pair of input channels, the 16 channels' two codes (zero
    codes where N or K is padded)."""
    n, k = weight.shape
    blocks, pairs = -(-n // 16), -(-k // 2)
    codes = torch.zeros(blocks * 16, pairs * 2, dtype=torch.uint8, device=weight.device)
    codes[:n, :k] = weight.view(torch.uint8)
    return codes.view(blocks, 16, pairs, 2).permute(0, 2, 1, 3).contiguous()


def cpu_kernels_status() -> str:
    """"loaded", or why the C++ CPU kernels are not in use."""
    return _load()[1]


_NO_SCALE = torch.ones(1)  # an unscaled cache's K/V scale (read, never written)


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     sliding_window: int | None = None) -> torch.Tensor:
    """``paged_decode_reference``'s contract (q [S, Hq, D] -> [S, Hq, D], scales broadcastable to
    [Hkv, 1]) through the C++ kernel, which computes in float32 whatever q's and the cache's dtypes."""
    ops = cpu_kernels()
    if ops is None:
        raise RuntimeError(f"the C++ paged-decode kernel is not available: {cpu_kernels_status()}")
    ks, vs = (_NO_SCALE if s is None else s.float().reshape(-1).contiguous() for s in (k_scale, v_scale))
    out = ops.paged_decode(q.float().contiguous(), k_cache.contiguous(), v_cache.contiguous(),
                           block_tables.long().contiguous(), seq_lens.long().contiguous(), ks, vs,
                           sliding_window or 0, q.shape[-1] ** -0.5)
    return out.to(q.dtype)


def build() -> int:
    """Build (or find) the library, with the compiler's output shown; exit status for the shell."""
    if os.environ.get(SWITCH, "1") == "0":
        print(f"qcompile CPU kernels: turned off ({SWITCH}=0)")
        return 0
    _build(verbose=True)
    print(f"qcompile CPU kernels: built, torch.ops.qcompile_cpu has {', '.join(_op_names())}")
    return 0


def _op_names() -> list[str]:
    return [name for name in ("paged_decode", "fp8_fake_quant_rows", "fp8_linear", "dense_linear", "int4_dense_linear") if hasattr(torch.ops.qcompile_cpu, name)]


if __name__ == "__main__":
    sys.exit(build())
