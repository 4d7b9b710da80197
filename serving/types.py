"""Request and stream types shared by the engine and every serving adapter.

One client interface: ``adapter.generate(prompt, params)`` returns an async iterator of
``StreamEvent``; the last event carries ``finish_reason``. The in-process engine, Triton (gRPC
and HTTP), ONNX Runtime and Ascend adapters all implement ``ServingAdapter``, and the benchmark
suite drives every target through it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import AsyncIterator, Protocol

from compiler.errors import QCompileError

FINISH_REASONS = ("stop", "length", "abort", "error")


class RequestError(QCompileError):
    """A request the engine cannot serve (empty, too long for the model or the cache, bad settings)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings, the same for every entry point (the engine's
    ``generate_stream(**kwargs)``, the adapters, ``qcompile generate``, Triton's model,
    ``qcompile.generate``); ``temperature == 0`` means greedy. ``stop``: one string or several."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()))
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")

    @classmethod
    def of(cls, params: "SamplingParams | None" = None, **settings) -> "SamplingParams":
        """``params``, or one built from keyword settings (``max_tokens=32, stop="\\n"``), never both."""
        if params is not None and settings:
            raise RequestError(f"give params or sampling settings ({', '.join(settings)}), not both")
        if params is not None:
            return params
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(settings) - known):
            raise RequestError(f"unknown sampling setting {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**settings)


@dataclass
class StreamEvent:
    """One step of a stream: the new token ids, their text delta, and on the last event why it ended."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


class ServingAdapter(Protocol):
    """What the benchmark suite and clients drive; one implementation per target."""

    name: str

    def generate(self, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[StreamEvent]:
        ...

    async def close(self) -> None:
        ...
