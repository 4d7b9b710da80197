"""Per-layer INT4 on the CPU: torch's INT4 kernel vs the dequantize reference vs a float32 matmul.

    python benchmarks/int4_cpu.py [--threads 1,2] [--tokens 1,16,128] [--min-time 0.2] [--repeats 3] [--json FILE]

For each layer shape (SmolLM2's MLP widths at its group size 64, and 4096x4096 at g128), thread
count and token count: ``Int4Linear.forward`` through ``aten._weight_int4pack_mm_for_cpu``
(activations in float32, computed in bfloat16), ``Int4Linear.reference_forward`` (unpack,
dequantize, float32 matmul: the path every call took before the kernel) and ``F.linear`` on the
float32 weight the layer was quantized from. Each figure is the median of ``--repeats`` samples, each a
loop of at least ``--min-time`` seconds (``benchmarks/common.py``). ``pack ms`` is the one-time repack at first use.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import measure, time_call, write_result  # noqa: E402
from compiler.formats.int4 import Int4Linear  # noqa: E402
from compiler.kernels.int4_cpu import REFERENCE_MIN_TOKENS, kernel_unavailable_reason  # noqa: E402

SHAPES = [(576, 1536, 64), (1536, 576, 64), (4096, 4096, 128)]  # K, N, group


def median_ms(fn, min_time: float, repeats: int) -> float:
    """The median ms per call of ``repeats`` samples, each enough calls of ``fn`` to last ``min_time`` seconds."""
    _, once = time_call(fn)
    calls = max(1, math.ceil(min_time / max(once["wall"], 1e-9)))
    return measure(fn, repeats, warmup=0, calls=calls).median_ms()


def layer_rows(k: int, n: int, group: int, threads: list[int], tokens: list[int], min_time: float, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False)
    layer = Int4Linear.from_float(linear, group)
    _, once = time_call(layer.cpu_pack)
    pack_ms = 1e3 * once["wall"]
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        for m in tokens:
            x = torch.randn(m, k)
            with torch.no_grad():
                row = {"shape": f"{k}->{n} g{group}", "threads": t, "tokens": m, "pack_ms": pack_ms,
                       "kernel_ms": median_ms(lambda: layer(x), min_time, repeats) if m < REFERENCE_MIN_TOKENS else None,
                       "reference_ms": median_ms(lambda: layer.reference_forward(x), min_time, repeats),
                       "float_ms": median_ms(lambda: F.linear(x, linear.weight), min_time, repeats)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="INT4 linear on the CPU, ms per call (median)")
    for col in ("layer", "threads", "tokens", "kernel", "reference", "float32", "kernel / float", "reference / kernel", "pack ms"):
        table.add_column(col, justify="left" if col == "layer" else "right")
    for r in rows:
        kernel = r["kernel_ms"]
        table.add_row(r["shape"], str(r["threads"]), str(r["tokens"]), "—" if kernel is None else f"{kernel:.3f}",
                      f"{r['reference_ms']:.3f}", f"{r['float_ms']:.3f}",
                      "—" if kernel is None else f"{kernel / r['float_ms']:.2f}",
                      "—" if kernel is None else f"{r['reference_ms'] / kernel:.1f}", f"{r['pack_ms']:.0f}")
    Console(width=160).print(table)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--tokens", default="1,16,128")
    parser.add_argument("--shapes", default=",".join(f"{k}x{n}g{g}" for k, n, g in SHAPES), help="layers as KxNgG, a comma list")
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per timed sample")
    parser.add_argument("--repeats", type=int, default=3, help="timed samples per figure (their median)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if kernel_unavailable_reason():
        sys.exit(f"no INT4 CPU kernel here: {kernel_unavailable_reason()}")
    threads, tokens = [int(v) for v in args.threads.split(",")], [int(v) for v in args.tokens.split(",")]
    shapes = [tuple(int(v) for v in s.replace("g", "x").split("x")) for s in args.shapes.split(",")]
    rows = [r for k, n, g in shapes for r in layer_rows(k, n, g, threads, tokens, args.min_time, args.repeats)]
    print_table(rows)
    return write_result(args.json, rows)


if __name__ == "__main__":
    main()
