"""Paged decode attention on the CPU: the C++ kernel against the torch reference, by cache dtype.

    python benchmarks/paged_decode_cpu.py [--threads 2] [--seqs 1,16] [--context 140] [--layers 30] [--repeats 5] [--json FILE]

SmolLM2's attention shapes (9 query heads, 3 KV heads, head dim 64, blocks of 16 tokens): ``--seqs``
sequences of ``--context`` cached tokens each, in randomly placed blocks, one cache per layer for
``--layers`` layers so that the K/V are cold in cache as in a decode step. Prints ms per layer (the median
of ``--repeats`` passes over the layers, ``benchmarks/common.py``) for
the reference (``paged_decode_reference``: gather the blocks into a buffer, dequantize an FP8 cache
there, torch's SDPA) and the C++ kernel (``compiler/kernels/cpu_ext.py``: reads each cached row in
place), with the kernel's relative error against the reference.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import measure, write_result  # noqa: E402
from compiler.kernels.cpu_ext import cpu_kernels_status, paged_decode_cpu  # noqa: E402
from serving.paged_attention import decode_mask, paged_decode_reference  # noqa: E402

HQ, HKV, D, BLOCK = 9, 3, 64, 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}


def layer_ms(run, caches, repeats: int) -> float:
    """ms per layer: the median of ``repeats`` passes over every layer's cache."""
    def one_pass():
        for k, v in caches:
            run(k, v)

    return measure(one_pass, repeats).median_ms() / len(caches)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seqs", default="1,16")
    p.add_argument("--context", type=int, default=140)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    rows = []
    torch.set_num_threads(args.threads)
    print(f"C++ CPU kernels: {cpu_kernels_status()}; {args.threads} threads, {args.context} cached tokens per sequence")
    print(f"{'cache':>14} {'seqs':>5} {'reference ms':>13} {'kernel ms':>10} {'speed-up':>9} {'rel. error':>11}")
    for name, dtype in DTYPES.items():
        for seqs in [int(s) for s in args.seqs.split(",")]:
            width = -(-args.context // BLOCK)
            blocks = seqs * width * 2
            g = torch.Generator().manual_seed(seqs)
            scale = torch.full((HKV, 1), 0.01) if dtype == torch.float8_e4m3fn else None
            caches = [tuple((torch.randn(blocks, BLOCK, HKV, D, generator=g) * 4).to(dtype) for _ in range(2))
                      for _ in range(args.layers)]
            q = torch.randn(seqs, HQ, D, generator=g)
            tables = torch.randperm(blocks, generator=g)[:seqs * width].view(seqs, width)
            lens = torch.full((seqs,), args.context)
            mask = decode_mask(lens, width * BLOCK, None)
            buffers = tuple(torch.empty(seqs * width * BLOCK * HKV * D, dtype=dtype) for _ in range(2))

            def reference(k, v):
                return paged_decode_reference(q, k, v, tables, lens, scale, scale, None, mask, buffers)

            def kernel(k, v):
                return paged_decode_cpu(q, k, v, tables, lens, scale, scale)

            ref_ms, kernel_ms = layer_ms(reference, caches, args.repeats), layer_ms(kernel, caches, args.repeats)
            want, got = reference(*caches[0]).double(), kernel(*caches[0]).double()
            err = float((got - want).norm() / want.norm())
            print(f"{name:>14} {seqs:>5} {ref_ms:>13.3f} {kernel_ms:>10.3f} {ref_ms / kernel_ms:>8.2f}x {err:>11.1e}")
            rows.append({"cache_dtype": name, "seqs": seqs, "reference_ms": ref_ms, "kernel_ms": kernel_ms, "rel_error": err})
    return write_result(args.json, rows, threads=args.threads, context=args.context, layers=args.layers)


if __name__ == "__main__":
    main()
