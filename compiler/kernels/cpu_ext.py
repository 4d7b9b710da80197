"""qcompile's C++ CPU kernels (``csrc/``): built for every ISA level, the best one this CPU runs loaded.

    ops = cpu_kernels()            # the op namespace for this process's level, or None
    why = cpu_kernels_status()     # "loaded (avx512_bf16)", or why not (no compiler, turned off, ...)
    with use_isa("avx2"): ...      # another level the CPU runs, for a block (tests, benchmarks)

``cpu_build`` builds one library per level (``cpu_isa.LEVELS``); the first use in a process loads
``cpu_isa.active_level()``'s (the best the CPU runs, capped by ``QCOMPILE_CPU_ISA``) as
``torch.ops.qcompile_cpu_<level>``. Every level has every op; they differ in the instructions
inside (``csrc/isa.h``). ``ops.isa()`` names the level a library was built for.

- ``paged_decode(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, window, sm_scale)``:
  the paged cache's decode attention, reading each cached row in place (float32, bfloat16,
  float16, FP8 E4M3 with its per-head scales, int8 with its per-channel ones: dequantized as it
  reads); ``serving/paged_attention.py``'s reference gathers every sequence's blocks into a buffer
  first. Same contract, checked against it in tests.
- ``fp8_fake_quant_rows(x, shift, static_scale, dtype)``: ``Fp8Linear``'s activation
  quantization in one op instead of about ten, bit for bit the torch ops of ``compiler/quant/fp8.py``;
  ``fp8_linear(x, shift, static_scale, dtype, weight, bias, packed)``: that, times the dequantized
  float32 weight (or ``packed``, that weight in ``dense_linear``'s layout), plus the bias, in one
  call (a float32 model's forward, whose Python path costs more than the rounding at a few tokens).
- ``fp8_linear_codes(x, shift, static_scale, activation_dtype, packed, weight_dtype, weight_scale,
  out_features, bias)``: ``Fp8Linear``'s forward on its codes (``pack_fp8_codes``' layout): the
  activation codes times the weight codes (their products are exact in float32), the scales
  applied to the float32 sums. Within ~2e-7 of the dequantize reference (the order of the float32
  roundings), 1 byte read per weight instead of the float copy's 4, and no float copy kept.
- ``rms_norm(x, weight, eps, weight_offset)``, ``rope_qk(q, k, cos, sin)``, ``silu_mul(gate, up)``:
  the decoder layer's RMSNorm, rotary embedding and SwiGLU (``compiler/model/layers.py``) in one op
  each, float32; RoPE bit for bit, SwiGLU bit for bit where torch vectorises the whole row (torch's
  own exp; the fused and separate gate/up both take the op, so they agree exactly), the norm within
  an ulp of its scale (a sum's order). A decode step runs them about a hundred times, where each
  torch op's dispatch costs more than its arithmetic. ``cpu_kernels_for(x)`` says whether a forward
  on x may use them.
- ``int4_linear(x, weight, group_size, scales_and_zeros, padded_in_features, bias)``:
  ``int4_cpu_matmul``'s casts, padding, torch's INT4 kernel and bias in one call, the same bits.
- ``dense_linear(x, packed, out_features, bias)``: a float32 linear layer on its weight packed in
  blocks of 16 output channels (``compiler/kernels/dense_cpu.py``); the weight read once as a
  stream, each row's sums in one order whatever the batch or level. Within ~1e-7 of ``F.linear``.
  ``int4_dense_linear(x, codes, scales, zeros, group_size, bias)``: an ``Int4Linear``'s many-token
  float32 forward on its own buffers, the dequantize reference's weights built a panel at a time
  for those tiles (``compiler/kernels/int4_cpu.py``).
- ``w4a8_linear(x, packed, scales, zero_scales, group_size, out_features, bias)``: an INT4 layer on
  int8 activations (W4A8: each row quantized per group, integer dot products),
  ``compiler/kernels/w4a8_cpu.py``'s packing; within ~1e-7 of its torch reference ``w4a8_reference``,
  the same bits at every level.
- ``w8a8_linear(x, packed, weight_sums, weight_scale, out_features, bias, input_scale,
  input_zero_point, symmetric)``: an int8 layer on int8 activations (W8A8), each row quantized in
  the call (per token, symmetric or not, or on a static per-tensor scale and zero point), integer
  dot products; ``compiler/quant/int8.py``'s ``int8_gemm`` of its codes bit for bit at every level
  (``compiler/kernels/w8a8_cpu.py``'s packing).

Where the kernels cannot be had (no compiler, a CPU below x86-64-v3, ``QCOMPILE_CPU_KERNELS=0`` to
compare against the reference) the callers run the torch reference and say so in their reports
(``cpu_kernels_status()``), never silently.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch

from compiler.kernels import cpu_build, cpu_isa

SWITCH = "QCOMPILE_CPU_KERNELS"


@functools.cache
def _built() -> tuple[bool, str]:
    """Build (or find) every level's library once per process: (built, why not)."""
    try:
        cpu_build.build()
    except Exception as e:  # no compiler or ninja, a failed build: the callers fall back and report it
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return False, f"not built ({first_line[:200]}); run 'python -m compiler.kernels.cpu_ext' to see the build log"
    return True, ""


@functools.cache
def _load(level: str) -> tuple[object | None, str]:
    """A level's op namespace (its library loaded once), or None and why."""
    if level not in cpu_isa.host_levels():
        return None, f"this CPU does not run {level} (it runs: {', '.join(cpu_isa.host_levels()) or 'none'})"
    built, why = _built()
    if not built:
        return None, why
    torch.ops.load_library(str(cpu_build.library_path(level)))
    return getattr(torch.ops, cpu_build.library_name(level)), f"loaded ({level})"


class _Active:
    """The process's kernels: resolved on first use, swapped by ``use_isa``."""

    ops: object | None = None
    status: str | None = None


def _resolve() -> None:
    if os.environ.get(SWITCH, "1") == "0":
        _Active.ops, _Active.status = None, f"turned off ({SWITCH}=0)"
        return
    level = cpu_isa.active_level()
    _Active.ops, _Active.status = _load(level) if level else (None, cpu_isa.no_level_reason())


def cpu_kernels():
    """The op namespace of this process's level (built on first use), or None when the kernels
    cannot be had or are turned off. Runs on every forward, so it is a plain attribute read."""
    if _Active.status is None:
        _resolve()
    return _Active.ops


def cpu_kernels_status() -> str:
    """"loaded (<level>)", or why the C++ CPU kernels are not in use."""
    cpu_kernels()
    return _Active.status


def cpu_isa_in_use() -> str | None:
    """The ISA level whose kernels this process runs, None without kernels."""
    ops = cpu_kernels()
    return None if ops is None else ops.isa()


def cpu_kernels_at(level: str):
    """A level's op namespace; ``RuntimeError`` naming why when this CPU cannot run it or it is not built."""
    ops, why = _load(level)
    if ops is None:
        raise RuntimeError(f"qcompile's {level} CPU kernels: {why}")
    return ops


@contextlib.contextmanager
def use_isa(level: str | None):
    """Run another level's kernels (one this CPU runs) inside the block, or none (``None``: the torch
    code): every caller of ``cpu_kernels()`` gets them. For tests and benchmarks that compare levels
    in one process; ``QCOMPILE_CPU_ISA`` sets a whole process's."""
    ops = None if level is None else cpu_kernels_at(level)
    cpu_kernels()
    before = _Active.ops, _Active.status
    _Active.ops, _Active.status = ops, "turned off (use_isa(None))" if level is None else f"loaded ({level})"
    try:
        yield ops
    finally:
        _Active.ops, _Active.status = before


def cpu_kernels_for(x: torch.Tensor):
    """``cpu_kernels()`` where a layer's forward on ``x`` may run them instead of its torch code: a
    float32 CPU tensor outside autograd (the ops have no backward); else None."""
    if x.dtype is torch.float32 and x.is_cpu and not torch.is_grad_enabled():
        return cpu_kernels()
    return None


def pack_fp8_codes(weight: torch.Tensor) -> torch.Tensor:
    """FP8 weight codes [N, K] -> ``fp8_linear_codes``' layout, uint8 [ceil(N/16), ceil(K/2), 16, 2]:
    per block of 16 output channels and pair of input channels, the 16 channels' two codes (zero
    codes where N or K is padded)."""
    n, k = weight.shape
    blocks, pairs = -(-n // 16), -(-k // 2)
    codes = torch.zeros(blocks * 16, pairs * 2, dtype=torch.uint8, device=weight.device)
    codes[:n, :k] = weight.view(torch.uint8)
    return codes.view(blocks, 16, pairs, 2).permute(0, 2, 1, 3).contiguous()


_NO_SCALE = torch.ones(1)  # an unscaled cache's K/V scale (read, never written)


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     sliding_window: int | None = None) -> torch.Tensor:
    """``paged_decode_reference``'s contract (q [S, Hq, D] -> [S, Hq, D], scales broadcastable to
    [Hkv, 1], or [Hkv, D] for an int8 cache) through the C++ kernel, which computes in float32
    whatever q's and the cache's dtypes."""
    ops = cpu_kernels()
    if ops is None:
        raise RuntimeError(f"the C++ paged-decode kernel is not available: {cpu_kernels_status()}")
    ks, vs = (_NO_SCALE if s is None else s.float().reshape(-1).contiguous() for s in (k_scale, v_scale))
    out = ops.paged_decode(q.float().contiguous(), k_cache.contiguous(), v_cache.contiguous(),
                           block_tables.long().contiguous(), seq_lens.long().contiguous(), ks, vs,
                           sliding_window or 0, q.shape[-1] ** -0.5)
    return out.to(q.dtype)


def main() -> int:
    """Build every level (the compiler's output shown) and say which one this CPU loads."""
    if os.environ.get(SWITCH, "1") == "0":
        print(f"qcompile CPU kernels: turned off ({SWITCH}=0)")
        return 0
    folder = cpu_build.build(verbose=True)
    print(f"qcompile CPU kernels: {', '.join(cpu_isa.LEVEL_NAMES)} built in {folder}; "
          f"this CPU runs {', '.join(cpu_isa.host_levels()) or 'none of them'}: {cpu_kernels_status()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
