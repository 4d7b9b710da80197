"""Load generation: concurrency held, Poisson arrivals on schedule, duration windows, stop keeps results."""
from __future__ import annotations

import asyncio
import random

import pytest
from bench_doubles import SleepingAdapter

from serving.bench.runner import LoadConfig, run_trial
from serving.bench.suite import run_sweep
from serving.bench.workload import BenchRequest
from serving.types import SamplingParams

REQUESTS = [BenchRequest([1, 2], 2, SamplingParams(max_tokens=3, ignore_eos=True))]


def _run(adapter, load, stop=None, on_done=None):
    return asyncio.run(run_trial(adapter, REQUESTS, load, stop or asyncio.Event(), on_done))


@pytest.mark.parametrize("concurrency", [1, 3])
def test_closed_loop_keeps_exactly_concurrency_in_flight(concurrency):
    adapter = SleepingAdapter()
    trial = _run(adapter, LoadConfig(concurrency=concurrency, num_requests=12, warmup=2))
    assert len(trial.records) == 12 and adapter.max_inflight == concurrency
    assert len(adapter.starts) == 14  # warm-up requests were sent, just not measured
    assert all(r.output_tokens == 3 and r.finish_reason == "length" for r in trial.records)


def test_open_loop_sends_on_the_seeded_poisson_schedule():
    rate, n = 400.0, 30
    adapter = SleepingAdapter(delay=0.001)
    trial = _run(adapter, LoadConfig(concurrency=None, request_rate=rate, num_requests=n, warmup=0, seed=5))
    rng = random.Random(5)
    scheduled, at = [], 0.0
    for _ in range(n):
        scheduled.append(at)
        at += rng.expovariate(rate)
    sent = [s - adapter.starts[0] for s in adapter.starts]
    assert len(trial.records) == n
    # never early (a sleep cannot be short); arrivals do not wait for earlier requests to finish
    assert all(s >= want - 1e-3 for s, want in zip(sent, scheduled))
    assert adapter.max_inflight > 1


def test_open_loop_caps_requests_in_flight():
    adapter = SleepingAdapter(delay=0.01)
    trial = _run(adapter, LoadConfig(concurrency=2, request_rate=1000.0, num_requests=10, warmup=0))
    assert len(trial.records) == 10 and adapter.max_inflight == 2


def test_duration_window_stops_starting_requests():
    adapter = SleepingAdapter(delay=0.01)
    trial = _run(adapter, LoadConfig(concurrency=2, num_requests=None, duration_s=0.3, warmup=0))
    assert len(trial.records) >= 2
    assert all(r.start < trial.started + 0.3 for r in trial.records)


def test_stop_cancels_in_flight_and_keeps_what_finished():
    adapter = SleepingAdapter(delay=0.01)
    stop = asyncio.Event()
    done = []

    def on_done(record):
        done.append(record)
        if len(done) == 5:
            stop.set()  # what the CLI's SIGINT handler does

    trial = _run(adapter, LoadConfig(concurrency=3, num_requests=100, warmup=0), stop, on_done)
    # the two other requests in flight at the stop are cancelled (or finish in that same instant); none starts
    assert trial.interrupted and len(trial.records) >= 5 and len(trial.records) + trial.cancelled_requests == 7
    assert all(r.ok for r in trial.records)


def test_sweep_runs_each_point_and_repeat():
    adapter = SleepingAdapter(delay=0.002)
    loads = [LoadConfig(concurrency=c, num_requests=4, warmup=1) for c in (1, 2)]
    runs, interrupted = asyncio.run(run_sweep(adapter, REQUESTS, loads, 2, {}, asyncio.Event()))
    assert not interrupted and [r["label"] for r in runs] == ["concurrency 1", "concurrency 2"]
    for run in runs:
        assert run["metrics"]["counts"]["requests"] == 8 and len(run["trials"]) == 2
        assert run["metrics"]["request_throughput"]["count"] == 2
        assert {q["trial"] for q in run["requests"]} == {0, 1}
