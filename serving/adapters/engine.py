"""The in-process adapter: ``ServingAdapter`` over ``serving.Engine`` (no server, no network)."""
from __future__ import annotations

from contextlib import aclosing
from pathlib import Path
from typing import AsyncIterator

from serving.engine import Engine
from serving.types import SamplingParams, StreamEvent


class EngineAdapter:
    """Drives an ``Engine`` in the caller's event loop; ``prompt`` is text or token ids."""

    name = "engine"

    def __init__(self, engine: Engine):
        self.engine = engine

    @classmethod
    def from_artifact(cls, path: str | Path, device: str | None = None, **plan_overrides) -> "EngineAdapter":
        return cls(Engine.from_artifact(path, device, **plan_overrides))

    async def generate(self, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[StreamEvent]:
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
        async with aclosing(self.engine.generate_stream(prompt=text, prompt_token_ids=ids, params=params)) as events:
            async for event in events:  # closed with this one: a client that leaves aborts the request at once
                yield event

    async def close(self) -> None:
        """Abort whatever is still in flight."""
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
