"""Float32 linear layers on the CPU: MKL's ``F.linear`` against oneDNN on a packed weight, by rows.

    python benchmarks/dense_cpu.py [--threads 2] [--rows 1,2,3,4,16,64] [--layers 30] [--repeats 10]

The layers are SmolLM2's decoder projections as the engine runs them (q/k/v fused 576 -> 960,
o 576 -> 576, gate/up fused 576 -> 3072, down 1536 -> 576), ``--layers`` copies of each, so that the
weights (SmolLM2's 425 MB at 30 layers) are cold in cache as in a decode step. Prints ms for one
pass over all of them per way; ``compiler/kernels/dense_cpu.py`` picks ``PACKED_FROM_ROWS`` from it (per CPU vendor).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)


def pass_ms(weights: list[torch.Tensor], inputs: dict[int, torch.Tensor], linear, repeats: int) -> float:
    def one_pass():
        for w in weights:
            linear(inputs[w.shape[1]], w)  # a packed weight keeps its [out, in] sizes

    one_pass()  # warm-up (oneDNN builds its primitive per shape on first use)
    start = time.perf_counter()
    for _ in range(repeats):
        one_pass()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,3,4,16,64")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for _ in range(args.layers) for k, n in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    onednn = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
    print(f"{args.layers} layers x {len(SHAPES)} projections, float32, {args.threads} threads: ms per pass")
    print(f"{'rows':>6} {'F.linear (MKL)':>16} {'oneDNN packed':>15}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {k: torch.randn(rows, k) for k in {k for k, _ in SHAPES}}
            mkl = pass_ms(weights, inputs, lambda x, w: F.linear(x, w), args.repeats)
            dnn = pass_ms(packed, inputs, onednn, args.repeats)
            print(f"{rows:>6} {mkl:>16.1f} {dnn:>15.1f}")


if __name__ == "__main__":
    main()
