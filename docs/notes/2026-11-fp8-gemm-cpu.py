"""CPU timing of the FP8 GEMM paths against a float32 matmul, on SmolLM2-135M's Linear shapes.

Kept beside its study (2026-11-fp8-gemm-cpu.md); it was benchmarks/fp8_gemm.py until issue 46 (last
there at commit 64101ec). It times ``_scaled_mm`` and the dequantize reference, paths ``Fp8Linear`` no
longer takes by default on the CPU (it multiplies by a float32 copy of its weight, or runs qcompile's
FP8 kernel on its codes: ``compiler/kernels/dispatch.py``), and ``Fp8Linear`` as it is now.

For each shape (M tokens × K in → N out) it times, in one run: the float32 ``x @ w.T``
(baseline), the dequantize reference, ``torch._scaled_mm`` and the whole ``Fp8Linear`` forward
(dynamic per-token activation quantization + ``_scaled_mm``); each as the median of
``--repeats`` runs, reported as a ratio to the baseline, with each path's relative error
against the dequantize reference and against float32.

    python docs/notes/2026-11-fp8-gemm-cpu.py --tokens 512 --repeats 20
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiler.formats.fp8 import Fp8Linear  # noqa: E402
from compiler.kernels.fp8_gemm import dequant_gemm, scaled_mm_gemm  # noqa: E402
from compiler.quant.fp8 import quantize_per_token  # noqa: E402

# (name, in_features K, out_features N) of SmolLM2-135M's Linears
SHAPES = [("q_proj / o_proj", 576, 576), ("k_proj / v_proj", 576, 192), ("gate / up", 576, 1536), ("down_proj", 1536, 576)]


def median_time(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    table = Table(title=f"FP8 GEMM on the CPU ({torch.get_num_threads()} threads), M={args.tokens}, median of {args.repeats}")
    for col in ("shape K→N", "float32 ms", "dequant ×", "_scaled_mm ×", "Fp8Linear ×", "_scaled_mm err vs ref", "Fp8Linear err vs f32"):
        table.add_column(col, justify="right")
    for name, k, n in SHAPES:
        linear = torch.nn.Linear(k, n, bias=False)
        x = torch.randn(args.tokens, k)
        q = Fp8Linear.from_linear(linear)
        xq, xs = quantize_per_token(x, torch.float8_e4m3fn)
        w, wq, ws = linear.weight, q.weight, q.weight_scale
        base = median_time(lambda: x @ w.t(), args.repeats)
        t_ref = median_time(lambda: dequant_gemm(xq, xs, wq, ws), args.repeats)
        t_mm = median_time(lambda: scaled_mm_gemm(xq, xs, wq, ws), args.repeats)
        t_lin = median_time(lambda: q(x), args.repeats)
        err_mm = rel(scaled_mm_gemm(xq, xs, wq, ws), dequant_gemm(xq, xs, wq, ws))
        table.add_row(f"{name} {k}→{n}", f"{1e3 * base:.2f}", f"{t_ref / base:.2f}", f"{t_mm / base:.2f}",
                      f"{t_lin / base:.2f}", f"{err_mm:.1e}", f"{rel(q(x), x @ w.t()):.4f}")
    Console(width=150).print(table)
    print("× = time / float32 time (lower is faster)")


if __name__ == "__main__":
    main()
