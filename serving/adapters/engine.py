"""The in-process adapter: ``ServingAdapter`` over ``serving.Engine`` (no server, no network)."""
from __future__ import annotations

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
        async for event in self.engine.generate_stream(
                prompt=text, prompt_token_ids=ids, max_tokens=params.max_tokens, temperature=params.temperature,
                top_k=params.top_k, top_p=params.top_p, seed=params.seed, stop=params.stop, ignore_eos=params.ignore_eos):
            yield event

    async def close(self) -> None:
        """Abort whatever is still in flight."""
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
