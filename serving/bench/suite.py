"""A benchmark: a sweep of load points, each run ``repeat`` times, into one versioned result.

Result JSON (``SCHEMA_VERSION`` 1; documented in docs/BENCH.md)::

    {"schema": "qcompile.bench", "schema_version": 1, "created": ISO-8601 UTC,
     "target": str, "adapter": str, "environment": {...}, "workload": {...}, "slos_ms": {...},
     "interrupted": bool,
     "runs": [{"label": str, "load": {...},
               "metrics": {METRIC: {"unit", "count", "mean", "std", "min", "max", "p50", "p90", "p95", "p99"},
                           "counts": {...}},
               "trials": [{"duration_s", "output_token_throughput", "request_throughput",
                           "mean_ms": {LATENCY_METRIC: float}}],
               "requests": [{"trial", "input_tokens", "output_tokens", "expected_output_tokens",
                             "time_to_first_token_ms", "request_latency_ms", "chunk_offsets_ms",
                             "chunk_tokens", "finish_reason", "error"}]}]}
"""
from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import replace
from typing import Callable

from serving.bench.metrics import LATENCY_METRICS, compute_metrics, trial_throughputs
from serving.bench.runner import LoadConfig, RequestRecord, TrialResult, run_trial
from serving.bench.workload import BenchRequest
from serving.types import ServingAdapter

SCHEMA = "qcompile.bench"
SCHEMA_VERSION = 1


def _request_row(trial_index: int, r: RequestRecord) -> dict:
    return {"trial": trial_index, "input_tokens": r.input_tokens, "output_tokens": r.output_tokens,
            "expected_output_tokens": r.expected_output_tokens,
            "time_to_first_token_ms": (r.chunk_times[0] - r.start) * 1e3 if r.chunk_times else None,
            "request_latency_ms": (r.end - r.start) * 1e3,
            "chunk_offsets_ms": [round((t - r.start) * 1e3, 4) for t in r.chunk_times],
            "chunk_tokens": r.chunk_tokens, "finish_reason": r.finish_reason, "error": r.error}


def _trial_row(trial: TrialResult, slos: dict) -> dict:
    single = compute_metrics([trial])
    return {"duration_s": trial.duration_s, **trial_throughputs(trial, slos),
            "mean_ms": {name: single[name]["mean"] for name in LATENCY_METRICS}}


def run_point(trials: list[TrialResult], load: LoadConfig, slos: dict) -> dict:
    """One entry of ``runs``: metrics over all trials, per-trial summaries, every request."""
    return {"label": load.label(), "load": load.describe(), "metrics": compute_metrics(trials, slos),
            "trials": [_trial_row(t, slos) for t in trials],
            "requests": [_request_row(i, r) for i, t in enumerate(trials) for r in t.records]}


async def run_sweep(adapter: ServingAdapter, requests: list[BenchRequest], loads: list[LoadConfig], repeat: int,
                    slos: dict, stop: asyncio.Event,
                    on_point: Callable[[LoadConfig, int], Callable[[RequestRecord], None] | None] | None = None) -> tuple[list[dict], bool]:
    """Run every load point ``repeat`` times; stops early (keeping what finished) when ``stop`` is set."""
    runs = []
    for load in loads:
        trials = []
        for i in range(repeat):
            if stop.is_set():
                break
            on_done = on_point(load, i) if on_point else None
            trials.append(await run_trial(adapter, requests, replace(load, seed=load.seed + i), stop, on_done))
        if any(t.records for t in trials):
            runs.append(run_point(trials, load, slos))
        if stop.is_set():
            break
    return runs, stop.is_set()


def make_result(target: str, adapter_name: str, environment: dict, workload: dict, slos: dict, runs: list[dict],
                interrupted: bool) -> dict:
    """The versioned result document (see module docstring)."""
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "target": target, "adapter": adapter_name, "environment": environment, "workload": workload,
            "slos_ms": slos, "interrupted": interrupted, "runs": runs}
