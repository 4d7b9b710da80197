"""The token loop shared by the runtime adapters: sample, detokenize, stop, stream.

An adapter wraps its runtime as a ``TokenModel`` (prefill a prompt, then decode one token at a
time against its own KV cache) and gets ``ServingAdapter.generate`` semantics from here.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Protocol

import numpy as np

from compiler.errors import ConfigError
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


async def stream_tokens(model: TokenModel, prompt_ids: list[int], params: SamplingParams, tokenizer,
                        eos_token_ids: list[int]) -> AsyncIterator[StreamEvent]:
    """Generate from ``prompt_ids``; one event per token, the last with its finish reason."""
    room = model.max_len - len(prompt_ids)
    if not prompt_ids or room < 1:
        raise ConfigError(f"prompt of {len(prompt_ids)} tokens does not fit the cache (max_len={model.max_len}) "
                          "with room to generate; shorten it or lower the model with a larger --max-len")
    budget = min(params.max_tokens, room)
    rng = np.random.default_rng(params.seed)
    logits = await asyncio.to_thread(model.prefill, prompt_ids)
    generated: list[int] = []
    text = ""
    for i in range(budget):
        token = sample(logits, params, rng)
        if token in eos_token_ids and not params.ignore_eos:
            yield StreamEvent(finish_reason="stop")
            return
        generated.append(token)
        new_text = tokenizer.decode(generated, skip_special_tokens=True) if tokenizer is not None else ""
        hits = [new_text.find(s, max(0, len(text) - len(s))) for s in params.stop]
        hits = [h for h in hits if h >= 0]
        if hits:
            yield StreamEvent([token], new_text[len(text):min(hits)], "stop")
            return
        last = i == budget - 1
        # Hold back a trailing U+FFFD: a multi-byte character split across tokens completes later.
        stable = new_text if last else new_text.rstrip("\ufffd")
        yield StreamEvent([token], stable[len(text):], "length" if last else None)
        text = stable if len(stable) >= len(text) else text
        if not last:
            logits = await asyncio.to_thread(model.decode, token)
