"""Load generation: drive a ``ServingAdapter`` in a closed or open loop and time every token.

  closed loop  ``concurrency`` workers, each sends its next request when the previous one
               finishes (what genai-perf's ``--concurrency`` and perf_analyzer do);
  open loop    requests arrive as a Poisson process at ``request_rate`` per second, whatever
               the server's state (vLLM's ``--request-rate``), optionally capped at
               ``concurrency`` requests in flight.

Warm-up requests run first at the same concurrency and are not measured. Measurement stops
after ``num_requests`` requests or, when ``duration_s`` is set, when no new request may start.
Setting ``stop`` (the CLI does on Ctrl-C) cancels in-flight requests and keeps the finished ones.
"""
from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from serving.bench.workload import BenchRequest
from serving.types import ServingAdapter

# Every timestamp comes from here (tests swap in a virtual clock to check metrics exactly).
clock = time.perf_counter


@dataclass(frozen=True)
class LoadConfig:
    """One load point: a closed loop at ``concurrency`` or an open loop at ``request_rate``."""

    concurrency: int | None = 1
    request_rate: float | None = None  # requests/s; None: closed loop
    num_requests: int | None = 64
    duration_s: float | None = None
    warmup: int = 2
    seed: int = 0

    @property
    def mode(self) -> str:
        return "open" if self.request_rate is not None else "closed"

    def label(self) -> str:
        if self.mode == "closed":
            return f"concurrency {self.concurrency}"
        cap = f", max {self.concurrency} in flight" if self.concurrency else ""
        return f"rate {self.request_rate:g}/s{cap}"

    def describe(self) -> dict:
        return {"mode": self.mode, "concurrency": self.concurrency, "request_rate": self.request_rate,
                "num_requests": self.num_requests, "duration_s": self.duration_s, "warmup": self.warmup, "seed": self.seed}


@dataclass
class RequestRecord:
    """What one request did, in ``clock()`` seconds (``time.perf_counter``). A chunk is a stream event carrying tokens."""

    input_tokens: int
    expected_output_tokens: int
    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason not in ("abort", "error") and self.output_tokens > 0


@dataclass
class TrialResult:
    """The measured requests of one run of a load point, and the window they were measured over."""

    records: list[RequestRecord]
    started: float
    finished: float
    interrupted: bool = False
    cancelled_requests: int = 0

    @property
    def duration_s(self) -> float:
        return self.finished - self.started


async def send_request(adapter: ServingAdapter, request: BenchRequest) -> RequestRecord:
    """Send one request and timestamp each stream event as it arrives."""
    record = RequestRecord(request.input_tokens, request.params.max_tokens, start=clock())
    try:
        async for event in adapter.generate(request.prompt, request.params):
            now = clock()
            if event.token_ids:
                record.chunk_times.append(now)
                record.chunk_tokens.append(len(event.token_ids))
            if event.finish_reason is not None:
                record.finish_reason = event.finish_reason
    except Exception as e:
        # A failure of the target is data (counted and shown), not a crash of the benchmark;
        # CancelledError is no Exception, so a stop still propagates.
        record.error = f"{type(e).__name__}: {e}"
    if record.output_tokens == 0 and record.error is None:
        record.error = "the stream ended without any token"
    record.end = clock()
    return record


class _Run:
    """Shared state of one trial: the request source, in-flight tasks, the stop conditions."""

    def __init__(self, adapter, requests: Iterator[BenchRequest], config: LoadConfig, stop: asyncio.Event,
                 on_done: Callable[[RequestRecord], None] | None):
        self.adapter, self.requests, self.config, self.stop, self.on_done = adapter, requests, config, stop, on_done
        self.records: list[RequestRecord] = []
        self.inflight: set[asyncio.Task] = set()
        self.cancelled = 0
        self.deadline = None

    def may_start(self) -> bool:
        return not self.stop.is_set() and (self.deadline is None or clock() < self.deadline)

    async def one(self, request: BenchRequest) -> None:
        task = asyncio.ensure_future(send_request(self.adapter, request))
        self.inflight.add(task)
        try:
            record = await task
        except asyncio.CancelledError:
            self.cancelled += 1
            return
        finally:
            self.inflight.discard(task)
        self.records.append(record)
        if self.on_done:
            self.on_done(record)

    async def watch_stop(self) -> None:
        await self.stop.wait()
        for task in list(self.inflight):
            task.cancel()


async def _closed_loop(run: _Run, concurrency: int) -> None:
    async def worker():
        while run.may_start():
            request = next(run.requests, None)
            if request is None:
                return
            await run.one(request)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _open_loop(run: _Run, rate: float, max_inflight: int | None, seed: int) -> None:
    """Poisson arrivals: exponential gaps of mean 1/rate from a seeded generator, scheduled on absolute times."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_inflight) if max_inflight else None
    tasks = []
    next_at = clock()

    async def gated(request):
        if limit is None:
            return await run.one(request)
        async with limit:
            if not run.stop.is_set():  # arrived before the stop; skipped if it was still queued behind the cap
                await run.one(request)

    while run.may_start():
        request = next(run.requests, None)
        if request is None:
            break
        tasks.append(asyncio.ensure_future(gated(request)))
        next_at += rng.expovariate(rate)
        delay = next_at - clock()
        if delay > 0:
            try:
                await asyncio.wait_for(run.stop.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass
    await asyncio.gather(*tasks)


def _source(requests: list[BenchRequest], count: int | None) -> Iterator[BenchRequest]:
    """The measured requests: the list cycled, ``count`` of them (unbounded when a duration is set)."""
    cycled = itertools.cycle(requests)
    return cycled if count is None else itertools.islice(cycled, count)


async def run_trial(adapter: ServingAdapter, requests: list[BenchRequest], config: LoadConfig, stop: asyncio.Event,
                    on_done: Callable[[RequestRecord], None] | None = None) -> TrialResult:
    """Warm up, then measure one load point; returns the finished requests and the measured window."""
    width = config.concurrency or 1
    if config.warmup:
        warm = _Run(adapter, _source(requests, config.warmup), config, stop, None)
        watcher = asyncio.ensure_future(warm.watch_stop())
        await _closed_loop(warm, width)
        watcher.cancel()
    run = _Run(adapter, _source(requests, None if config.duration_s else config.num_requests), config, stop, on_done)
    watcher = asyncio.ensure_future(run.watch_stop())
    started = clock()
    if config.duration_s:
        run.deadline = started + config.duration_s
    if config.mode == "closed":
        await _closed_loop(run, width)
    else:
        await _open_loop(run, config.request_rate, config.concurrency, config.seed)
    watcher.cancel()
    finished = max((r.end for r in run.records), default=started)
    return TrialResult(run.records, started, finished, interrupted=stop.is_set(), cancelled_requests=run.cancelled)
