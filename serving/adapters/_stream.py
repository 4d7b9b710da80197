"""The token loop shared by the runtime adapters: sample, detokenize, stop, stream (the text and its
stop strings through ``serving.output_text``, as the engine's requests).

An adapter wraps its runtime as a ``TokenModel`` (prefill a prompt, then decode one token at a
time against its own KV cache) and gets ``ServingAdapter.generate`` semantics from ``stream_tokens``.
Each request's sampling, detokenizing and stopping is a ``TokenStream``, so an adapter that decodes
many requests in one batch (``onnx_batch.py``) gives each the same semantics.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Protocol

import numpy as np

from compiler.errors import ConfigError
from serving.output_text import OutputText
from serving.types import SamplingParams, StreamEvent


class TokenModel(Protocol):
    max_len: int  # prompt + generated tokens the cache holds

    def prefill(self, prompt_ids: list[int]) -> np.ndarray:
        """Logits [V] after the prompt."""
        ...

    def decode(self, token_id: int) -> np.ndarray:
        """Logits [V] after one more token."""
        ...


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Greedy when temperature is 0; otherwise temperature, then top-k, then top-p (nucleus)."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / params.temperature
    if params.top_k:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs)
        keep = np.cumsum(probs[order]) - probs[order] < params.top_p  # smallest set reaching top_p
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return int(rng.choice(len(probs), p=probs))


def encode(prompt: str | list[int], tokenizer) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ConfigError("this bundle has no tokenizer: send token ids instead of text")
        return list(tokenizer(prompt)["input_ids"])
    return list(prompt)


class TokenStream:
    """One request's side of generation, fed one logits vector at a time: sample the next token,
    detokenize it, and decide whether the request is done (EOS, a stop string, its token budget).
    ``stream_tokens`` drives one with a ``TokenModel``; the ONNX Runtime batcher drives many at once."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, tokenizer, eos_token_ids: list[int], max_len: int):
        room = max_len - len(prompt_ids)
        if not prompt_ids or room < 1:
            raise ConfigError(f"prompt of {len(prompt_ids)} tokens does not fit the cache (max_len={max_len}) "
                              "with room to generate; shorten it or lower the model with a larger --max-len")
        self.prompt_ids, self.params, self.tokenizer, self.eos_token_ids = prompt_ids, params, tokenizer, eos_token_ids
        self.budget = min(params.max_tokens, room)
        self.rng = np.random.default_rng(params.seed)
        self.generated: list[int] = []
        self.output = OutputText(tokenizer, params.stop)
        self.finished = False

    @property
    def text(self) -> str:
        """The output text so far, cut at a stop string."""
        return self.output.text

    @property
    def token(self) -> int:
        """The last token sampled: what the next decode step feeds."""
        return self.generated[-1]

    def next(self, logits: np.ndarray) -> StreamEvent:
        """The event for the token sampled from ``logits`` [V]; the last event carries a finish reason."""
        params = self.params
        token = sample(logits, params, self.rng)
        self.generated.append(token)  # EOS included, as the engine counts it
        eos = token in self.eos_token_ids and not params.ignore_eos
        last = eos or len(self.generated) == self.budget
        text, stopped = self.output.update(self.generated, final=last)
        reason = "stop" if eos or stopped else "length" if last else None
        event = StreamEvent([token], text, reason)
        return self._finish(event) if reason else event

    def _finish(self, event: StreamEvent) -> StreamEvent:
        self.finished = True
        return event


async def stream_tokens(model: TokenModel, prompt_ids: list[int], params: SamplingParams, tokenizer,
                        eos_token_ids: list[int]) -> AsyncIterator[StreamEvent]:
    """Generate from ``prompt_ids``; one event per token, the last with its finish reason."""
    stream = TokenStream(prompt_ids, params, tokenizer, eos_token_ids, model.max_len)
    logits = await asyncio.to_thread(model.prefill, prompt_ids)
    while True:
        event = stream.next(logits)
        yield event
        if stream.finished:
            return
        logits = await asyncio.to_thread(model.decode, stream.token)
