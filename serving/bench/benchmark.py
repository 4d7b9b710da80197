"""``run_benchmark``: resolve a target, build the workload, run the sweep, return the result document.

What ``qcompile bench TARGET`` runs (the command line parses flags and prints; this does the work),
and what the example's latency stage and any script call:

    from serving.bench.benchmark import load_points, run_benchmark
    from serving.bench.workload import LengthDist, WorkloadConfig

    result = run_benchmark("out/awq", WorkloadConfig(LengthDist("fixed", 128), LengthDist("fixed", 64)),
                           load_points([1, 4]))
"""
from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from serving.bench import targets
from serving.bench.environment import environment
from serving.bench.errors import BenchError
from serving.bench.runner import LoadConfig
from serving.bench.suite import make_result, run_sweep
from serving.bench.workload import WorkloadConfig, build_requests


def load_points(concurrencies: list[int] = (), request_rates: list[float] = (), num_requests: int = 64,
                duration_s: float | None = None, warmup: int = 2, seed: int = 0) -> list[LoadConfig]:
    """The sweep: a closed loop per concurrency (default 1), or an open loop per request rate, where
    one concurrency caps the requests in flight. ``duration_s`` replaces the request count."""
    for name, values in (("--concurrency", concurrencies), ("--request-rate", request_rates)):
        if any(v <= 0 for v in values):
            raise BenchError(f"{name} {','.join(map(str, values))}: values must be > 0")
    common = dict(num_requests=None if duration_s else num_requests, duration_s=duration_s, warmup=warmup, seed=seed)
    if not request_rates:
        return [LoadConfig(concurrency=c, **common) for c in concurrencies or [1]]
    if len(concurrencies) > 1:
        raise BenchError("with --request-rate, --concurrency is one number (the cap on requests in flight), not a list")
    cap = concurrencies[0] if concurrencies else None
    return [LoadConfig(concurrency=cap, request_rate=r, **common) for r in request_rates]


def run_benchmark(target: str, workload: WorkloadConfig, loads: list[LoadConfig], repeat: int = 1,
                  slos: dict | None = None, tokenizer: Path | None = None, stream: bool = True,
                  engine_plan: dict | None = None) -> dict:
    """Benchmark ``target`` (an artifact, ONNX or Ascend bundle, or ``triton-grpc://`` / ``triton-http://``
    URL) at each load point, ``repeat`` trials each; the result document (``serving.bench.suite``).
    ``engine_plan``: serving-plan settings over an artifact's own (the in-process engine only).

    Ctrl-C stops the sweep and keeps what finished (``interrupted`` is then true). Raises
    ``BenchError`` when no request finished, or when every request of a load point failed."""
    slos = slos or {}
    parsed = targets.parse_target(target)
    targets.check_stream(parsed, stream)
    count = max([load.num_requests or 0 for load in loads] + [64])
    requests = build_requests(workload, targets.target_tokenizer(parsed, tokenizer), count)
    adapter = targets.open_adapter(parsed, stream, engine_plan)
    runs, interrupted = asyncio.run(_sweep_with_progress(adapter, requests, loads, repeat, slos))
    if not runs:
        raise BenchError("no request finished; nothing was measured")
    engine = getattr(adapter, "engine", None)  # the in-process engine: what its forward runs, ISA level included
    # its scheduler's counters over the whole sweep, warm-up included (prompt tokens served from the prefix cache, ...)
    stats = getattr(getattr(engine, "scheduler", None), "stats", None)
    result = make_result(target, getattr(adapter, "name", type(adapter).__name__), environment(targets.artifact_dir(parsed)),
                         {**workload.describe(), "repeat": repeat, "stream": stream,
                          **({"engine_plan": engine_plan} if engine_plan else {}),
                          **({"engine_kernels": engine.load_report.kernels} if engine is not None else {}),
                          **({"engine_stats": dict(vars(stats))} if stats is not None else {})}, slos, runs, interrupted)
    _check_failures(result)
    return result


async def _sweep_with_progress(adapter, requests, loads, repeat: int, slos: dict):
    """Run the sweep with a progress bar (stderr); Ctrl-C sets ``stop`` so what finished is kept."""
    from compiler.progress import make_progress

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        with make_progress() as progress:
            def on_point(load, trial):
                total = load.num_requests if load.num_requests else None
                task = progress.add_task(f"{load.label()} (trial {trial + 1}/{repeat})", total=total)
                return lambda record: progress.advance(task)

            return await run_sweep(adapter, requests, loads, repeat, slos, stop, on_point)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        await adapter.close()


def _check_failures(result: dict) -> None:
    """Every request failed: that is an error (with the target's message), not a result."""
    for run in result["runs"]:
        counts = run["metrics"]["counts"]
        if counts["successful"] == 0:
            first = next((q["error"] for q in run["requests"] if q["error"]), "no tokens")
            raise BenchError(f"every request at {run['label']} failed; first error: {first}")
