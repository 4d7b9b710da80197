"""Prefix caching off and on: ``qcompile bench`` with a shared prefix, the engine's prefix cache each way.

    python benchmarks/serving_prefix.py --model smollm2 --requests 16 --prefix-len 256 --suffix-len 32 --output-len 32

Each way is ``qcompile bench MODEL --shared-prefix P --prompt-len S --output-len O --concurrency R
--num-requests R --warmup 0`` (all requests at once, no warm-up: nothing is cached before them), the
engine's ``enable_prefix_caching`` off, then on. Reports each way's mean time to first token and
the prompt tokens the engine served from its cache (``engine_stats`` of the result), and the TTFT
ratio. ``--model`` is an artifact, or a checkpoint compiled to a float artifact first.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402
from benchmarks.serving_throughput import artifact_of  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="an artifact, or a checkpoint (compiled to float first)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from serving.bench.benchmark import load_points, run_benchmark
    from serving.bench.workload import LengthDist, WorkloadConfig

    workload = WorkloadConfig(LengthDist("fixed", args.suffix_len), LengthDist("fixed", args.output_len),
                              shared_prefix=args.prefix_len)
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as work:
        artifact = artifact_of(args.model, Path(work))
        for caching in (False, True):
            bench = run_benchmark(str(artifact), workload, load_points([args.requests], num_requests=args.requests, warmup=0),
                                  engine_plan={"enable_prefix_caching": caching})
            metrics, stats = bench["runs"][0]["metrics"], bench["workload"].get("engine_stats", {})
            results["on" if caching else "off"] = bench
            rows.append({"prefix_caching": caching, "ttft_mean_ms": metrics["time_to_first_token"]["mean"],
                         "prompt_tokens": stats.get("num_prompt_tokens"),
                         "prompt_tokens_from_cache": stats.get("num_cached_prompt_tokens"),
                         "output_tok_s": metrics["output_token_throughput"]["mean"]})
    off, on = rows
    ratio = off["ttft_mean_ms"] / on["ttft_mean_ms"]
    print(f"TTFT mean {off['ttft_mean_ms']:.1f} ms without the prefix cache, {on['ttft_mean_ms']:.1f} ms with it "
          f"({ratio:.2f}x); {on['prompt_tokens_from_cache']} of {on['prompt_tokens']} prompt tokens from the cache")
    return write_result(args.json, rows, model=args.model, ttft_ratio_off_over_on=ratio, bench=results)


if __name__ == "__main__":
    main()
