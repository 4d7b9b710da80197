"""Metrics of a benchmark run, named and defined as NVIDIA genai-perf and vLLM's serving benchmark do.

Per request (``RequestRecord``; a chunk is a stream event carrying tokens):
  time_to_first_token    first chunk's arrival - send time
  request_latency        end of the stream - send time
  time_per_output_token  (request_latency - time_to_first_token) / (output_tokens - 1), requests with
                         >= 2 output tokens (vLLM's TPOT; genai-perf reports this per-request average as ITL)
  inter_token_latency    every gap between consecutive chunks, pooled over requests (vLLM's ITL)
Per trial (the window from the first measured send to the last measured end):
  output_token_throughput  output tokens of successful requests / window
  request_throughput       successful requests / window
  goodput                  successful requests meeting every SLO / window (vLLM's definition)
Latencies are reported in ms. Each latency metric pools the requests of all trials; each
throughput is computed per trial and summarized across trials (one trial: std 0).
Statistics: mean, population std (numpy's default, as genai-perf), min, max and linearly
interpolated percentiles (numpy's default, as genai-perf and vLLM).
"""
from __future__ import annotations

import math

import numpy as np

from compiler.options import split_list
from serving.bench.errors import BenchError
from serving.bench.runner import RequestRecord, TrialResult

PERCENTILES = (50, 90, 95, 99)
LATENCY_METRICS = ("time_to_first_token", "inter_token_latency", "time_per_output_token", "request_latency")
THROUGHPUT_METRICS = ("output_token_throughput", "request_throughput")
# Short names accepted by --goodput (vLLM's) for the genai-perf names.
SLO_ALIASES = {"ttft": "time_to_first_token", "itl": "inter_token_latency", "tpot": "time_per_output_token",
               "e2el": "request_latency"}


def summarize(values: list[float], unit: str) -> dict:
    """mean, std, min, max, p50/p90/p95/p99 and count of ``values`` (NaN stats when empty)."""
    if any(not math.isfinite(v) for v in values):
        raise BenchError("a measured value is not finite; the timings are corrupt")
    stats: dict = {"unit": unit, "count": len(values)}
    arr = np.asarray(values, dtype=np.float64)
    empty = arr.size == 0
    stats["mean"] = float("nan") if empty else float(arr.mean())
    stats["std"] = float("nan") if empty else float(arr.std())
    stats["min"] = float("nan") if empty else float(arr.min())
    stats["max"] = float("nan") if empty else float(arr.max())
    for p in PERCENTILES:
        stats[f"p{p}"] = float("nan") if empty else float(np.percentile(arr, p))
    return stats


def request_values(record: RequestRecord) -> dict[str, float]:
    """The per-request latencies in seconds (``time_per_output_token`` only with >= 2 output tokens)."""
    ttft = record.chunk_times[0] - record.start
    latency = record.end - record.start
    values = {"time_to_first_token": ttft, "request_latency": latency}
    if record.output_tokens > 1:
        values["time_per_output_token"] = (latency - ttft) / (record.output_tokens - 1)
    return values


def chunk_gaps(record: RequestRecord) -> list[float]:
    """Seconds between consecutive chunks of one request (vLLM's ITL samples)."""
    return [b - a for a, b in zip(record.chunk_times, record.chunk_times[1:])]


def parse_slos(spec: str | None) -> dict[str, float]:
    """``--goodput "time_to_first_token:200,request_latency:2000"`` (ms; vLLM's ttft/tpot/itl/e2el accepted)."""
    if not spec:
        return {}
    slos = {}
    for item in split_list(spec):
        name, _, value = item.partition(":")
        name = SLO_ALIASES.get(name, name)
        try:
            limit = float(value)
        except ValueError:
            limit = -1.0
        if name not in LATENCY_METRICS or limit <= 0:
            raise BenchError(f"--goodput item {item!r} is not valid; use METRIC:MS with METRIC one of "
                             f"{', '.join(LATENCY_METRICS)} (or ttft, itl, tpot, e2el) and MS > 0")
        slos[name] = limit
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether one request met every SLO (ms); a request's ITL is its mean chunk gap."""
    values = request_values(record)
    gaps = chunk_gaps(record)
    values["inter_token_latency"] = sum(gaps) / len(gaps) if gaps else 0.0
    values.setdefault("time_per_output_token", 0.0)
    return all(values[name] * 1e3 <= limit for name, limit in slos.items())


def trial_throughputs(trial: TrialResult, slos: dict[str, float]) -> dict[str, float]:
    """Per-trial rates over the measured window (zero when the window is empty)."""
    ok = [r for r in trial.records if r.ok]
    window = trial.duration_s
    rate = (lambda n: n / window) if window > 0 else (lambda n: 0.0)
    rates = {"output_token_throughput": rate(sum(r.output_tokens for r in ok)), "request_throughput": rate(len(ok))}
    if slos:
        rates["goodput"] = rate(sum(meets_slos(r, slos) for r in ok))
    return rates


def compute_metrics(trials: list[TrialResult], slos: dict[str, float] | None = None) -> dict:
    """All metrics of one load point (its trials), keyed by genai-perf names, plus request counts."""
    slos = slos or {}
    records = [r for t in trials for r in t.records]
    ok = [r for r in records if r.ok]
    per_request: dict[str, list[float]] = {name: [] for name in LATENCY_METRICS}
    for r in ok:
        for name, seconds in request_values(r).items():
            per_request[name].append(seconds * 1e3)
        per_request["inter_token_latency"].extend(g * 1e3 for g in chunk_gaps(r))
    metrics = {name: summarize(per_request[name], "ms") for name in LATENCY_METRICS}
    rates = [trial_throughputs(t, slos) for t in trials]
    units = {"output_token_throughput": "tokens/s", "request_throughput": "requests/s", "goodput": "requests/s"}
    for name in rates[0] if rates else THROUGHPUT_METRICS:
        metrics[name] = summarize([r[name] for r in rates], units[name])
    if slos:
        metrics["goodput"]["slos_ms"] = slos
    metrics["input_sequence_length"] = summarize([r.input_tokens for r in ok], "tokens")
    metrics["output_sequence_length"] = summarize([r.output_tokens for r in ok], "tokens")
    metrics["counts"] = {
        "requests": len(records), "successful": len(ok), "failed": len(records) - len(ok),
        "cancelled": sum(t.cancelled_requests for t in trials),
        "output_tokens": sum(r.output_tokens for r in ok),
        "output_length_mismatch": sum(r.output_tokens != r.expected_output_tokens for r in ok),
        "trials": len(trials), "window_s": [t.duration_s for t in trials],
    }
    return metrics
