"""Driving the one token loop (``serving.request.Request``) from a runtime that is not the engine.

An adapter wraps its runtime as a ``TokenModel`` (prefill a prompt, then decode one token at a
time against its own KV cache); ``admit`` turns a prompt into a ``Request`` whose token budget
fits that cache, and ``stream_tokens`` (async) or ``token_events`` (the same loop, synchronous)
feed the model's logits to it. The ONNX Runtime batcher (``onnx_batch.py``) feeds many requests
from one batched call instead; every runtime's sampling, stop strings and EOS are the Request's.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import AsyncIterator, Iterator, Protocol

import numpy as np

from compiler.errors import ConfigError
from serving.request import Request
from serving.types import SamplingParams, StreamEvent

_ids = itertools.count()


class TokenModel(Protocol):
    max_len: int  # prompt + generated tokens the cache holds

    def prefill(self, prompt_ids: list[int]) -> np.ndarray:
        """Logits [V] after the prompt."""
        ...

    def decode(self, token_id: int) -> np.ndarray:
        """Logits [V] after one more token."""
        ...


def encode(prompt: str | list[int], tokenizer) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ConfigError("this bundle has no tokenizer: send token ids instead of text")
        return list(tokenizer(prompt)["input_ids"])
    return list(prompt)


def admit(prompt_ids: list[int], params: SamplingParams, tokenizer, eos_token_ids: list[int], max_len: int) -> Request:
    """A request for a runtime whose cache holds ``max_len`` tokens: refused when the prompt leaves
    no room to generate, its token budget cut to the room left (it then ends with "length")."""
    room = max_len - len(prompt_ids)
    if not prompt_ids or room < 1:
        raise ConfigError(f"prompt of {len(prompt_ids)} tokens does not fit the cache (max_len={max_len}) "
                          "with room to generate; shorten it or lower the model with a larger --max-len")
    params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
    return Request(f"req-{next(_ids)}", prompt_ids, params, eos_token_ids, tokenizer)


def token_events(model: TokenModel, request: Request) -> Iterator[StreamEvent]:
    """Generate ``request`` on ``model``: one event per token, the last with its finish reason.
    A consumer that stops iterating stops the decoding (nothing runs ahead of it)."""
    logits = model.prefill(request.prompt_token_ids)
    while True:
        yield request.next(logits)
        if request.finished:
            return
        logits = model.decode(request.last_token)


async def stream_tokens(model: TokenModel, request: Request) -> AsyncIterator[StreamEvent]:
    """``token_events`` with each model call in a worker thread, so the event loop stays free."""
    events = token_events(model, request)
    while (event := await asyncio.to_thread(next, events, None)) is not None:
        yield event
