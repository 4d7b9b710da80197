"""The model runner: one scheduled batch in, the logits of the requests that sample next out.

The engine core (``serving/engine.py``) decides which requests run and how many of their tokens;
the runner turns that into one forward (as vLLM's ``*_model_runner.py``): the scheduled tokens
flattened into one [1, T] row with their positions, each token's cache slot and each sequence's
block table for the paged cache (``BatchMetadata``), and the model run over them, projecting to
the vocabulary only the rows that sample.
"""
from __future__ import annotations

import torch

from serving.kv_manager import KVCacheManager
from serving.paged_cache import BatchMetadata, PagedKVCache, PrefillSeq
from serving.request import Request
from serving.scheduler import SchedulerOutput


class ModelRunner:
    """Runs a prepared model (``engine_setup.prepare_model``) on its paged cache; the block tables come from ``kv``."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, kv: KVCacheManager, device: torch.device):
        self.model, self.cache, self.kv, self.device = model, cache, kv, device

    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[Request]]:
        """Logits [S, V] (float32) for the S requests whose known tokens are all computed after
        this step, and those requests, in row order."""
        self.cache.copy_blocks(sched.copies)
        ids, positions, sample_idx, sampled = self._prepare(sched)
        return self._forward(ids, positions, sample_idx), sampled

    def _prepare(self, sched: SchedulerOutput):
        """Flatten the scheduled tokens and build the cache's batch metadata."""
        bs = self.kv.block_size
        ids, positions, slots, sample_idx, sampled = [], [], [], [], []
        decode_idx, decode_tables, decode_lens, prefills = [], [], [], []
        for req, n in sched.scheduled:
            start = req.num_computed_tokens
            block_ids = self.kv.block_ids(req.request_id)
            q_start = len(ids)
            ids += req.all_token_ids[start:start + n]
            positions += range(start, start + n)
            slots += [block_ids[p // bs] * bs + p % bs for p in range(start, start + n)]
            if start + n == req.num_tokens:  # all its tokens will be computed: sample the next one
                sample_idx.append(q_start + n - 1)
                sampled.append(req)
            if n == 1:
                decode_idx.append(q_start)
                decode_tables.append(block_ids)
                decode_lens.append(start + 1)
            else:
                prefills.append(PrefillSeq(q_start, n, start + n, torch.tensor(block_ids, device=self.device)))
        width = max((len(t) for t in decode_tables), default=0)
        dev = self.device
        self.cache.set_batch(BatchMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            decode_token_idx=torch.tensor(decode_idx, dtype=torch.long, device=dev),
            decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long,
                                             device=dev).reshape(len(decode_tables), width),
            decode_seq_lens=torch.tensor(decode_lens, dtype=torch.long, device=dev),
            prefills=prefills,
        ))
        return (torch.tensor([ids], device=dev), torch.tensor([positions], device=dev),
                torch.tensor(sample_idx, dtype=torch.long, device=dev), sampled)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, sample_idx: torch.Tensor) -> torch.Tensor:
        """The model's forward on [1, T] with the paged cache, projecting only the rows that sample
        (``Transformer.forward`` would compute logits for every token: [T, vocab] per step)."""
        m = self.model
        x = m.embed_tokens(ids)
        cos, sin = m.rope(positions, x.dtype)
        for layer in m.layers:
            x = layer(x, cos, sin, positions, self.cache)
        return m.logits(x[0, sample_idx]).float()  # [S, V]
