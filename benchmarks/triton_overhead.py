"""Overhead of serving through Triton: TTFT and inter-token latency via Triton (gRPC streaming and
HTTP generate_stream) against the in-process engine, same artifact, same workload, same run.

    qcompile compile smollm2 -c examples/float.toml -o out/smollm2-float
    python benchmarks/triton_overhead.py out/smollm2-float --requests 8 --concurrency 4 \
        --prompt-len 64 --output-len 16

Every row is ``qcompile bench TARGET --concurrency C --num-requests N --warmup W --prompt-len P
--output-len O``: the artifact in-process, then ``triton-grpc://`` and ``triton-http://`` on a Triton
server this script starts on the artifact lowered with ``qcompile lower --target triton``, then the
artifact in-process again (the ratios use the mean of its two runs, which also shows drift on a
shared machine). TTFT is ``time_to_first_token``; ITL, the mean gap between a request's consecutive
tokens (genai-perf's), is ``time_per_output_token``. ``--no-triton`` runs the in-process rows only.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402


def bench_row(target: str, args) -> dict:
    """One ``qcompile bench`` load point: TTFT and per-request ITL, mean and median."""
    from serving.bench.benchmark import load_points, run_benchmark
    from serving.bench.workload import LengthDist, WorkloadConfig

    workload = WorkloadConfig(LengthDist("fixed", args.prompt_len), LengthDist("fixed", args.output_len))
    result = run_benchmark(target, workload, load_points([args.concurrency], num_requests=args.requests, warmup=args.warmup),
                           tokenizer=args.artifact)
    m = result["runs"][0]["metrics"]
    ttft, itl = m["time_to_first_token"], m["time_per_output_token"]
    return {"ttft_mean_ms": ttft["mean"], "ttft_p50_ms": ttft["p50"], "itl_mean_ms": itl["mean"], "itl_p50_ms": itl["p50"],
            "requests": m["counts"]["successful"], "tokens": m["counts"]["output_tokens"]}


def through_triton(args) -> dict[str, dict]:
    """The artifact lowered to a Triton repository, served, and benched over gRPC and HTTP."""
    import backends  # noqa: F401  (registers the triton target)
    from backends.triton.runtime import ServerOptions, TritonServer, free_port, prepare_runtime
    from compiler.deploy.lowering import lower

    prepare_runtime()
    repo = Path(args.workdir) / "triton-repo"
    lower(args.artifact, "triton", repo, {"name": "bench"}, force=True)
    opts = ServerOptions(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    with TritonServer(opts, log_path=Path(args.workdir) / "tritonserver.log") as server:
        return {"Triton gRPC stream": bench_row(f"triton-grpc://{server.grpc_url}/bench", args),
                "Triton HTTP generate_stream": bench_row(f"triton-http://{server.http_url}/bench", args)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--workdir", default="out/bench-triton")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads, here and in the server (OMP_NUM_THREADS); 1 avoids spin-wait collapse on a shared CPU")
    p.add_argument("--no-triton", action="store_true", help="the in-process rows only")
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the server's stub processes
    import torch

    torch.set_num_threads(args.threads)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    rows = {"in-process engine (before)": bench_row(str(args.artifact), args)}
    if not args.no_triton:
        rows.update(through_triton(args))
    rows["in-process engine (after)"] = bench_row(str(args.artifact), args)
    base = {k: statistics.mean([rows["in-process engine (before)"][k], rows["in-process engine (after)"][k]])
            for k in ("ttft_p50_ms", "itl_p50_ms")}
    table = [{"adapter": name, **r, "ttft_p50_vs_in_process": r["ttft_p50_ms"] / base["ttft_p50_ms"],
              "itl_p50_vs_in_process": r["itl_p50_ms"] / base["itl_p50_ms"]} for name, r in rows.items()]
    print("| adapter | TTFT mean ms | TTFT p50 ms | ITL mean ms | ITL p50 ms | TTFT p50 × in-process | ITL p50 × in-process |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in table:
        print(f"| {r['adapter']} | {r['ttft_mean_ms']:.0f} | {r['ttft_p50_ms']:.0f} | {r['itl_mean_ms']:.1f} | "
              f"{r['itl_p50_ms']:.1f} | {r['ttft_p50_vs_in_process']:.2f} | {r['itl_p50_vs_in_process']:.2f} |")
    return write_result(args.json, table, artifact=str(args.artifact), requests=args.requests,
                        concurrency=args.concurrency, prompt_len=args.prompt_len, output_len=args.output_len)


if __name__ == "__main__":
    main()
