"""Test doubles for the benchmark suite: serving adapters whose token timings are known."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from serving.types import SamplingParams, StreamEvent


class VirtualClock:
    """A clock that only moves when told: patched in for ``time.perf_counter`` so timings are exact."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(frozen=True)
class Script:
    """One request's stream: first chunk after ``ttft`` s, then one chunk per gap; ``chunk_tokens`` per chunk."""

    ttft: float
    gaps: tuple[float, ...] = ()
    chunk_tokens: tuple[int, ...] | None = None
    fail: str | None = None


class ScriptedAdapter:
    """TEST DOUBLE of a ServingAdapter: replays ``scripts`` in call order on a ``VirtualClock``."""

    name = "scripted-test-double"

    def __init__(self, clock: VirtualClock, scripts: list[Script]):
        self.clock, self.scripts, self.calls = clock, scripts, 0
        self.closed = False

    async def generate(self, prompt, params: SamplingParams):
        script = self.scripts[self.calls % len(self.scripts)]
        self.calls += 1
        if script.fail:
            raise RuntimeError(script.fail)
        sizes = script.chunk_tokens or (1,) * (len(script.gaps) + 1)
        self.clock.advance(script.ttft)
        for i, size in enumerate(sizes):
            if i:
                self.clock.advance(script.gaps[i - 1])
            last = i == len(sizes) - 1
            yield StreamEvent(token_ids=[7] * size, text="x" * size, finish_reason="length" if last else None)

    async def close(self):
        self.closed = True


class SleepingAdapter:
    """TEST DOUBLE of a ServingAdapter: ``max_tokens`` one-token events ``delay`` s apart (real asyncio sleeps);
    records how many requests were in flight at once and when each started."""

    name = "sleeping-test-double"

    def __init__(self, delay: float = 0.005):
        self.delay, self.inflight, self.max_inflight, self.starts = delay, 0, 0, []

    async def generate(self, prompt, params: SamplingParams):
        import time

        self.starts.append(time.perf_counter())
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            for i in range(params.max_tokens):
                await asyncio.sleep(self.delay)
                yield StreamEvent(token_ids=[3], finish_reason="length" if i == params.max_tokens - 1 else None)
        finally:
            self.inflight -= 1

    async def close(self):
        pass
