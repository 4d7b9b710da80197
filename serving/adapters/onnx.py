"""``ServingAdapter`` over ONNX Runtime: the bundle from ``qcompile lower --target onnx``.

A bundle whose attention is GroupQueryAttention (the default lowering) serves concurrent requests
in one batch: continuous batching, each request prefilled on its own and then decoded with the
others in one graph call per step (``onnx_batch.py``). A bundle lowered with
``--no-fused-attention`` (or before GroupQueryAttention) has one length for the whole batch, so
its requests are served one at a time (a lock queues the rest).
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from pathlib import Path
from typing import AsyncIterator

import numpy as np

from backends.onnx.runner import OnnxRunner
from compiler.io.types import load_tokenizer
from serving.adapters._stream import admit, encode, stream_tokens
from serving.adapters.onnx_batch import ContinuousBatcher
from serving.types import SamplingParams, StreamEvent

# Requests decoded together; more wait for a free row. The cache holds this many rows of max_len
# positions, but only the pages of positions written are ever touched (backends/onnx/runner.py).
DEFAULT_MAX_BATCH = 16


class _RunnerModel:
    """OnnxRunner as a TokenModel (batch 1)."""

    def __init__(self, runner: OnnxRunner):
        self.runner, self.max_len = runner, runner.info.max_len

    def prefill(self, prompt_ids: list[int]) -> np.ndarray:
        return self.runner.prefill(np.array([prompt_ids], np.int64))[0, -1]

    def decode(self, token_id: int) -> np.ndarray:
        return self.runner.decode(np.array([[token_id]], np.int64))[0, -1]


class OnnxRuntimeAdapter:
    """Streams tokens from an ONNX bundle; greedy, temperature, top-k, top-p, seed, stop strings."""

    name = "onnxruntime"

    def __init__(self, bundle_dir: str | Path, threads: int | None = None, max_batch: int = DEFAULT_MAX_BATCH):
        self.runner = OnnxRunner(bundle_dir, threads)
        self.tokenizer = load_tokenizer(Path(bundle_dir)) if self.runner.info.tokenizer else None
        self.batcher = ContinuousBatcher(self.runner, max_batch) if self.runner.per_row else None
        self._lock = asyncio.Lock()

    @classmethod
    def from_dir(cls, bundle_dir: str | Path) -> "OnnxRuntimeAdapter":
        """The adapter for a bundle written by ``qcompile lower --target onnx`` (what the bench suite calls)."""
        return cls(bundle_dir)

    async def generate(self, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[StreamEvent]:
        info = self.runner.info
        request = admit(encode(prompt, self.tokenizer), params, self.tokenizer, info.eos_token_ids, info.max_len)
        if self.batcher is not None:
            async with aclosing(self.batcher.generate(request)) as events:  # a client that leaves frees its row now
                async for event in events:
                    yield event
            return
        async with self._lock:
            async for event in stream_tokens(_RunnerModel(self.runner), request):
                yield event

    async def close(self) -> None:
        if self.batcher is not None:
            await self.batcher.close()
        self.runner = None
