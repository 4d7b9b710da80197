"""Overhead of serving through Triton: TTFT and inter-token latency via Triton (gRPC streaming and
HTTP generate_stream) against the in-process engine, same artifact, same workload, same run.

    qcompile compile smollm2 -c examples/float.toml -o out/smollm2-float
    python benchmarks/triton_overhead.py out/smollm2-float --requests 8 --concurrency 4 \
        --prompt-len 64 --output-len 16

Prompts are real text (token windows of the pydoc corpus), sent as token ids so every run has
exactly ``--prompt-len`` prompt tokens; output length is enforced with ignore_eos. The in-process
engine runs before and after the server (the ratio uses their mean) to expose drift on a shared
machine. Definitions (as genai-perf): TTFT = first token's arrival - request start; ITL = mean gap
between consecutive tokens of a request, from its first token to its last.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from serving.types import SamplingParams  # noqa: E402


def make_prompts(artifact: Path, n: int, length: int) -> list[list[int]]:
    from calib import load_corpus_text
    from compiler.io.types import load_tokenizer

    ids = load_tokenizer(artifact)(load_corpus_text("pydoc")[:200_000])["input_ids"]
    stride = max(length, (len(ids) - length) // n)
    return [ids[i * stride: i * stride + length] for i in range(n)]


async def one_request(adapter, prompt: list[int], params: SamplingParams) -> dict:
    start = time.perf_counter()
    arrivals = []
    async for event in adapter.generate(prompt, params):
        arrivals.extend([time.perf_counter()] * max(1, len(event.token_ids)))
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"ttft": arrivals[0] - start, "itl": statistics.mean(gaps) if gaps else 0.0, "tokens": len(arrivals)}


async def run_load(adapter, prompts, params: SamplingParams, concurrency: int, warmup: int) -> list[dict]:
    for prompt in prompts[:warmup]:
        await one_request(adapter, prompt, params)
    queue = list(prompts)
    results = []

    async def worker():
        while queue:
            results.append(await one_request(adapter, queue.pop(0), params))

    await asyncio.gather(*[worker() for _ in range(concurrency)])
    await adapter.close()
    return results


def summarize(results: list[dict]) -> dict:
    ttft = sorted(r["ttft"] * 1e3 for r in results)
    itl = sorted(r["itl"] * 1e3 for r in results)
    return {"ttft_mean_ms": statistics.mean(ttft), "ttft_p50_ms": statistics.median(ttft),
            "itl_mean_ms": statistics.mean(itl), "itl_p50_ms": statistics.median(itl),
            "requests": len(results), "tokens": sum(r["tokens"] for r in results)}


def in_process(artifact: Path, prompts, params, args) -> dict:
    from serving.adapters.engine import EngineAdapter

    return summarize(asyncio.run(run_load(EngineAdapter.from_artifact(artifact), prompts, params, args.concurrency, args.warmup)))


def through_triton(artifact: Path, prompts, params, args) -> dict[str, dict]:
    import backends  # noqa: F401
    from backends.triton.runtime import (
        ServerOptions,
        TritonServer,
        free_port,
        prepare_runtime,
    )
    from compiler.deploy.lowering import lower
    from serving.adapters.triton_grpc import TritonGrpcAdapter
    from serving.adapters.triton_http import TritonHttpAdapter

    prepare_runtime()
    repo = Path(args.workdir) / "triton-repo"
    lower(artifact, "triton", repo, {"name": "bench"}, force=True)
    opts = ServerOptions(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    out = {}
    with TritonServer(opts, log_path=Path(args.workdir) / "tritonserver.log") as server:
        for name, adapter in (("triton-grpc", TritonGrpcAdapter(server.grpc_url, "bench")),
                              ("triton-http", TritonHttpAdapter(server.http_url, "bench"))):
            out[name] = summarize(asyncio.run(run_load(adapter, prompts, params, args.concurrency, args.warmup)))
    return out


def main() -> None:
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
    p.add_argument("--json", type=Path, help="Also write the results here.")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the server's stub processes
    import torch

    torch.set_num_threads(args.threads)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(args.artifact, args.requests, args.prompt_len)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)

    console = Console(width=max(120, Console().width))
    console.print("in-process engine …")
    rows = {"in-process (before)": in_process(args.artifact, prompts, params, args)}
    console.print("Triton (start, gRPC, HTTP) …")
    rows.update(through_triton(args.artifact, prompts, params, args))
    console.print("in-process engine again …")
    rows["in-process (after)"] = in_process(args.artifact, prompts, params, args)
    base = {k: statistics.mean([rows["in-process (before)"][k], rows["in-process (after)"][k]]) for k in ("ttft_p50_ms", "itl_p50_ms")}

    table = Table(title=f"{args.artifact.name}: {args.requests} requests, concurrency {args.concurrency}, "
                        f"{args.prompt_len} prompt / {args.output_len} output tokens")
    for col in ("adapter", "TTFT mean ms", "TTFT p50 ms", "ITL mean ms", "ITL p50 ms", "TTFT p50 ×", "ITL p50 ×"):
        table.add_column(col, justify="left" if col == "adapter" else "right")
    for name, r in rows.items():
        table.add_row(name, f"{r['ttft_mean_ms']:.1f}", f"{r['ttft_p50_ms']:.1f}", f"{r['itl_mean_ms']:.2f}", f"{r['itl_p50_ms']:.2f}",
                      f"{r['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}", f"{r['itl_p50_ms'] / base['itl_p50_ms']:.2f}")
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
