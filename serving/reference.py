"""The reference decoder as one more runtime of the token loop: the model as loaded (no fusion, no
packing, no paged cache), a contiguous KV cache, one request at a time. ``qcompile.generate`` runs
it, so its sampling, stop strings and EOS are those of the engine and the adapters
(``serving/request.py``), and its greedy tokens are ``Transformer.generate``'s.
"""
from __future__ import annotations

import torch

from compiler.model.kv_cache import ContiguousKVCache
from serving.adapters._stream import token_events
from serving.request import Request
from serving.types import SamplingParams


class ReferenceDecoder:
    """A ``TokenModel`` over the model's own forward, as ``Transformer.generate`` runs it."""

    def __init__(self, model: torch.nn.Module, max_len: int):
        c = model.config
        p = next(model.parameters())
        heads, dim, values = c.kv_cache_layout
        self.model, self.max_len, self.device = model, max_len, p.device
        self.cache = ContiguousKVCache(c.n_layers, 1, max_len, heads, dim, p.dtype, p.device, c.sliding_windows,
                                       keys_only=not values)
        self.length = 0  # tokens in the cache

    @torch.no_grad()
    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        self.length = len(prompt_ids)
        positions = torch.arange(self.length, device=self.device)[None]
        return self.model(torch.tensor([prompt_ids], device=self.device), positions, self.cache)[0, -1]

    @torch.no_grad()
    def decode(self, token_id: int) -> torch.Tensor:
        positions = torch.tensor([[self.length]], device=self.device)
        self.length += 1
        return self.model(torch.tensor([[token_id]], device=self.device), positions, self.cache)[0, -1]


def complete(model: torch.nn.Module, tokenizer, prompt: str, params: SamplingParams) -> str:
    """The text the reference decoder generates after ``prompt``, cut at a stop string."""
    ids = tokenizer(prompt)["input_ids"]
    decoder = ReferenceDecoder(model, len(ids) + params.max_tokens)
    request = Request("reference", ids, params, model.config.eos_token_ids, tokenizer, decoder.device)
    for _ in token_events(decoder, request):
        pass
    return request.text
