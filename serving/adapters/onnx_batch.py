"""Continuous batching over one ONNX Runtime bundle whose attention takes a length per row.

A bundle lowered with GroupQueryAttention (``OnnxBundleInfo.attention == "gqa"``) decodes rows of
different lengths in one graph call, so concurrent requests share each decode step:

    waiting ──prefill, one request per call──► running: cache rows 0..n-1 ──one decode call──► next tokens
                                                  ▲                                              │
                                                  └──── a finished row's place goes to the last row

Between two decode steps the loop first prefills the requests that arrived (while fewer than
``max_batch`` run), then decodes one token for every running row in one call, and lets the
finished ones go. The running rows stay packed at the front of the cache (the last row's cached
positions are copied into a finished row's place), so each call binds rows 0..n-1 as one
contiguous [n, Hkv, L, D] view of the cache, with no slot left idle in it.

Each request samples, detokenizes and stops through its own ``serving.request.Request`` (the
one token loop), as one request served alone does: given the same logits it yields the same
events (greedy tokens identical: tests/serving/adapters/test_onnx_serving.py).
"""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator

import numpy as np

from backends.onnx.runner import OnnxRunner
from compiler.errors import ConfigError
from serving.request import Request
from serving.types import StreamEvent


@dataclass(eq=False)
class _Row:
    request: Request
    events: asyncio.Queue  # StreamEvent, or the exception that ended it
    length: int = 0  # tokens in its cache row
    cancelled: bool = False  # its consumer stopped reading: the row is freed after the current step


class ContinuousBatcher:
    """Serves many requests over one ``OnnxRunner`` (a "gqa" bundle), up to ``max_batch`` decoding at once."""

    def __init__(self, runner: OnnxRunner, max_batch: int):
        if not runner.per_row:
            raise ConfigError(f"{runner.dir}: its graphs take one length for the whole batch; lower it again "
                              "without --no-fused-attention to serve concurrent requests in one batch")
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        self.runner, self.max_batch = runner, max_batch
        self.cache = runner.new_cache(max_batch)
        self.waiting: deque[_Row] = deque()
        self.running: list[_Row] = []  # running[i] owns cache row i
        self.largest_batch = 0  # the most rows one decode call has had (tests and benchmarks read it)
        self._task: asyncio.Task | None = None

    async def generate(self, request: Request) -> AsyncIterator[StreamEvent]:
        """One request's events, as ``stream_tokens`` yields them (``_stream.admit`` has fitted it to the cache)."""
        row = _Row(request, asyncio.Queue())
        self.waiting.append(row)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            while True:
                item = await row.events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            row.cancelled = True  # harmless once finished; frees the row of a consumer that left early

    async def close(self) -> None:
        """Stop the loop; every request still in flight ends with an "abort" event."""
        if self._task is not None:
            self._task.cancel()
        for row in [*self.running, *self.waiting]:
            if not row.cancelled:
                row.events.put_nowait(StreamEvent(finish_reason="abort"))
            row.cancelled = True
        self.running, self.waiting = [], deque()

    async def _run(self) -> None:
        while self.waiting or self.running:
            await self._admit()
            if self.running:
                await self._step()
            await asyncio.sleep(0)  # let consumers read, and new requests in, between steps

    async def _admit(self) -> None:
        """Prefill waiting requests into the free rows, one graph call each, and deliver their first tokens."""
        while self.waiting and len(self.running) < self.max_batch:
            row = self.waiting.popleft()
            if row.cancelled:
                continue
            ids = np.array([row.request.prompt_token_ids], np.int64)
            index = len(self.running)
            self.running.append(row)
            try:
                logits = await asyncio.to_thread(self.runner.prefill_row, self.cache, index, ids)
            except Exception as e:  # noqa: BLE001 -- this request's failure is delivered to it, the others go on
                self._fail([row], e)
                continue
            row.length = ids.shape[1]
            self._deliver(row, logits[0, -1])
        self._release()

    async def _step(self) -> None:
        """One decode call for every running row, then their next tokens."""
        rows = list(self.running)
        ids = np.array([[r.request.last_token] for r in rows], np.int64)
        past_lens = np.array([r.length for r in rows], np.int64)
        self.largest_batch = max(self.largest_batch, len(rows))
        try:
            logits = await asyncio.to_thread(self.runner.decode_rows, self.cache, ids, past_lens)
        except Exception as e:  # noqa: BLE001 -- every request in the call gets the error; none waits forever
            self._fail(rows, e)
            return
        for i, row in enumerate(rows):
            row.length += 1
            self._deliver(row, logits[i, -1])
        self._release()

    def _deliver(self, row: _Row, logits: np.ndarray) -> None:
        if not row.cancelled:
            row.events.put_nowait(row.request.next(logits))

    def _fail(self, rows: list[_Row], error: Exception) -> None:
        for row in rows:
            row.events.put_nowait(error)
            row.cancelled = True
        self._release()

    def _release(self) -> None:
        """Drop finished and abandoned rows; the last row moves into each gap, keeping rows 0..n-1 packed."""
        gone = [i for i, r in enumerate(self.running) if r.cancelled or r.request.finished]
        for i in reversed(gone):  # from the back, so the row moved in is never one that is leaving
            last = len(self.running) - 1
            if i != last:
                self.cache.move_row(last, i, self.running[last].length)
                self.running[i] = self.running[last]
            self.running.pop()
