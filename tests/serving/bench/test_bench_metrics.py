"""Every metric and percentile of the benchmark suite, checked exactly against hand-computed values.

The adapter is a test double (``ScriptedAdapter``) replaying known token timings on a virtual
clock, so each expected figure below is worked out by hand from the scripts, not by the code under test.
"""
from __future__ import annotations

import asyncio
import math

import pytest
from bench_doubles import Script, ScriptedAdapter, VirtualClock

from serving.bench import runner
from serving.bench.errors import BenchError
from serving.bench.metrics import compute_metrics, parse_slos
from serving.bench.runner import LoadConfig, run_trial
from serving.bench.workload import BenchRequest
from serving.types import SamplingParams

WARMUP = Script(ttft=9.0, gaps=(9.0,))  # would dominate every figure if warm-up leaked into the measurement
SCRIPTS = [
    WARMUP, WARMUP,
    Script(ttft=0.100, gaps=(0.020, 0.020, 0.020)),  # 4 tokens, latency 160 ms, TPOT 20 ms
    Script(ttft=0.200, gaps=(0.010, 0.050)),  # 3 tokens, latency 260 ms, TPOT 30 ms
    Script(ttft=0.300),  # 1 token, latency 300 ms, no TPOT, no ITL
    Script(ttft=0.400, gaps=(0.040,), chunk_tokens=(2, 3)),  # 5 tokens in 2 chunks, latency 440 ms, TPOT 10 ms
]
WINDOW_S = 0.160 + 0.260 + 0.300 + 0.440  # closed loop at concurrency 1 on a clock that moves only in the double


def _request(max_tokens: int = 4) -> BenchRequest:
    return BenchRequest([1, 2, 3], 3, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _measure(monkeypatch, scripts=SCRIPTS, warmup=2, num_requests=4, slos=None):
    clock = VirtualClock()
    monkeypatch.setattr(runner, "clock", clock)
    adapter = ScriptedAdapter(clock, scripts)
    load = LoadConfig(concurrency=1, num_requests=num_requests, warmup=warmup)
    trial = asyncio.run(run_trial(adapter, [_request()], load, asyncio.Event()))
    return trial, compute_metrics([trial], slos or {})


def _check(stats: dict, expected: dict) -> None:
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key


def test_latency_metrics_and_percentiles_exact(monkeypatch):
    trial, m = _measure(monkeypatch)
    assert len(trial.records) == 4  # the two warm-up requests are not measured
    assert trial.duration_s == pytest.approx(WINDOW_S)
    _check(m["time_to_first_token"], dict(count=4, mean=250, std=math.sqrt(12500), min=100, max=400,
                                          p50=250, p90=370, p95=385, p99=397))
    _check(m["request_latency"], dict(count=4, mean=290, std=math.sqrt(10100), min=160, max=440,
                                      p50=280, p90=398, p95=419, p99=435.8))
    _check(m["time_per_output_token"], dict(count=3, mean=20, std=math.sqrt(200 / 3), min=10, max=30,
                                            p50=20, p90=28, p95=29, p99=29.8))
    # ITL: every chunk gap, pooled: 20, 20, 20, 10, 50, 40 ms
    _check(m["inter_token_latency"], dict(count=6, mean=160 / 6, std=math.sqrt(1133.3333333333333 / 6), min=10, max=50,
                                          p50=20, p90=45, p95=47.5, p99=49.5))
    for name in ("time_to_first_token", "request_latency", "time_per_output_token", "inter_token_latency"):
        assert m[name]["unit"] == "ms"


def test_throughput_and_counts_exact(monkeypatch):
    _, m = _measure(monkeypatch)
    _check(m["output_token_throughput"], dict(count=1, mean=13 / WINDOW_S, std=0, p50=13 / WINDOW_S, p99=13 / WINDOW_S))
    _check(m["request_throughput"], dict(count=1, mean=4 / WINDOW_S, std=0, p50=4 / WINDOW_S))
    assert m["counts"]["requests"] == 4 and m["counts"]["successful"] == 4 and m["counts"]["failed"] == 0
    assert m["counts"]["output_tokens"] == 13
    # max_tokens was 4 for each request: the 3-, 1- and 5-token streams did not honour it
    assert m["counts"]["output_length_mismatch"] == 3
    _check(m["output_sequence_length"], dict(mean=13 / 4, min=1, max=5))
    _check(m["input_sequence_length"], dict(mean=3, std=0))


@pytest.mark.parametrize("spec, good", [("time_to_first_token:250", 2), ("ttft:250,tpot:25", 1),
                                         ("request_latency:300", 3), ("itl:25", 2), ("e2el:100", 0)])
def test_goodput_counts_requests_meeting_every_slo(monkeypatch, spec, good):
    _, m = _measure(monkeypatch, slos=parse_slos(spec))
    assert m["goodput"]["mean"] == pytest.approx(good / WINDOW_S)
    assert m["goodput"]["unit"] == "requests/s"


@pytest.mark.parametrize("spec", ["ttft", "ttft:-3", "latency:100", "ttft:abc"])
def test_bad_slo_is_a_one_line_error(spec):
    with pytest.raises(BenchError, match="--goodput"):
        parse_slos(spec)


def test_failed_requests_are_counted_not_measured(monkeypatch):
    scripts = [Script(ttft=0.1, gaps=(0.1,)), Script(ttft=0.0, fail="server said no")]
    trial, m = _measure(monkeypatch, scripts=scripts, warmup=0, num_requests=4)
    assert m["counts"]["requests"] == 4 and m["counts"]["successful"] == 2 and m["counts"]["failed"] == 2
    assert m["time_to_first_token"]["count"] == 2 and m["time_to_first_token"]["mean"] == pytest.approx(100)
    assert "server said no" in trial.records[1].error


def test_empty_measurement_gives_nan_not_numbers(monkeypatch):
    _, m = _measure(monkeypatch, scripts=[Script(ttft=0.0, fail="down")], warmup=0, num_requests=2)
    assert m["counts"]["successful"] == 0
    assert math.isnan(m["time_to_first_token"]["mean"]) and m["request_throughput"]["mean"] == 0
