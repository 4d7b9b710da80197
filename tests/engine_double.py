"""TEST DOUBLE of ``serving.Engine`` (issue 4): same API, no batching, greedy only.

It serves one request at a time with the spine's contiguous-cache decoder, so the Triton
plumbing (lowering, server, streaming, errors, cancellation) can be tested on its own. It is
not the engine: the lowered model uses ``serving:Engine`` unless a test swaps this in through
the ``engine_class`` parameter of config.pbtxt.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

import torch

from compiler.artifact import load_artifact
from compiler.kv_cache import ContiguousKVCache
from serving.types import StreamEvent


class SequentialEngineDouble:
    """Greedy decoding, one request at a time, streamed token by token."""

    def __init__(self, loaded):
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.dtype = next(self.model.parameters()).dtype
        self.lock = asyncio.Lock()

    @classmethod
    def from_artifact(cls, path: str) -> "SequentialEngineDouble":
        return cls(load_artifact(path))

    async def generate_stream(self, prompt: str | None = None, prompt_token_ids: list[int] | None = None, max_tokens: int = 16,
                              temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                              stop: tuple[str, ...] = (), ignore_eos: bool = False) -> AsyncIterator[StreamEvent]:
        if temperature != 0:
            raise ValueError("the engine double decodes greedily only (temperature 0)")
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenizer(prompt)["input_ids"]
        c = self.model.config
        if len(ids) + max_tokens > c.max_seq_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context of {c.max_seq_len}")
        async with self.lock:
            cache = ContiguousKVCache(c.n_layers, 1, len(ids) + max_tokens, c.n_kv_heads, c.head_dim, self.dtype, "cpu",
                                      c.sliding_window)
            x = torch.tensor([ids])
            pos = torch.arange(len(ids))[None]
            for step in range(max_tokens):
                with torch.no_grad():
                    token = int(self.model(x, pos, cache)[0, -1].argmax())
                eos = token in c.eos_token_ids and not ignore_eos
                reason = "stop" if eos else "length" if step + 1 == max_tokens else None
                yield StreamEvent([token], self.tokenizer.decode([token]), reason)
                if reason:
                    return
                x, pos = torch.tensor([[token]]), torch.tensor([[len(ids) + step]])
                await asyncio.sleep(0)  # let other requests queue up, as a server would
