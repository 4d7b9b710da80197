"""Training data: a corpus packed into fixed-length sequences, read in a seeded, resumable order.

The corpus is tokenized once and split by the calib protocol: training packs only the pool (the
first 70% of the tokens); the evaluation region (the last 30%) is held out and never trained on.
``teacher_sequences`` adds text the teacher writes itself (LLM-QAT's data-free recipe, Liu et al.
2023) from short prompts cut out of the pool, for when the pool is too small.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from calib import evaluation_windows, load_corpus_text, split_tokens
from calib.corpus import CorpusError
from compiler.progress import track
from passes.distill.errors import DistillConfigError


def pack_sequences(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of ``seq_len`` tokens -> [n, seq_len] (the tail shorter than one is dropped)."""
    n = len(tokens) // seq_len
    if n < 1:
        raise DistillConfigError(f"the training pool holds {len(tokens)} tokens, fewer than seq_len={seq_len}; use a larger corpus or a shorter seq_len")
    return tokens[: n * seq_len].view(n, seq_len)


@dataclass
class DataPosition:
    """Where the loader is: which pass over the data, and how many sequences of it were read."""

    epoch: int = 0
    cursor: int = 0

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}


class PackedLoader:
    """Yields global batches of packed sequences in a per-epoch permutation seeded by ``seed + epoch``.

    The order depends only on (seed, position), not on global RNG state, so a resumed run reads the
    same batches as an uninterrupted one.
    """

    def __init__(self, sequences: torch.Tensor, seed: int, position: DataPosition | None = None):
        self.sequences = sequences
        self.seed = seed
        self.position = position or DataPosition()

    def _order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(len(self.sequences), generator=torch.Generator().manual_seed(self.seed + epoch))

    def next_batch(self, n: int) -> torch.Tensor:
        """The next ``n`` sequences -> [n, seq_len], crossing into the next epoch when one ends."""
        rows = []
        while len(rows) < n:
            order = self._order(self.position.epoch)
            take = order[self.position.cursor : self.position.cursor + n - len(rows)].tolist()
            rows += take
            self.position.cursor += len(take)
            if self.position.cursor >= len(order):
                self.position = DataPosition(self.position.epoch + 1, 0)
        return self.sequences[rows]


def corpus_tokens(tokenizer, corpus: str):
    """The tokenized corpus split by the calib protocol (pool, evaluation)."""
    try:
        text = load_corpus_text(corpus)
    except CorpusError as e:
        raise DistillConfigError(str(e)) from None
    return split_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])


def heldout_windows(tokenizer, corpus: str, windows: int, eval_len: int) -> torch.Tensor:
    """The first ``windows`` evaluation windows of ``corpus`` (never trained on) -> [windows, eval_len]."""
    try:
        return evaluation_windows(corpus_tokens(tokenizer, corpus).evaluation, windows, eval_len)
    except ValueError as e:
        raise DistillConfigError(f"held-out {corpus!r}: {e}") from None


@torch.no_grad()
def teacher_sequences(teacher, pool: torch.Tensor, n: int, seq_len: int, seed: int, prompt_len: int = 16,
                      batch_size: int = 64) -> torch.Tensor:
    """``n`` sequences of ``seq_len`` tokens -> [n, seq_len]: each a ``prompt_len``-token prompt from a
    seeded random place in ``pool``, then the teacher's continuation sampled at temperature 1.
    ``batch_size`` 64 writes a sequence of SmolLM2-135M in 0.78 s on 2 CPU cores, 32 in 1.2 s; the
    sampled text depends on it (one random stream per batch)."""
    if len(pool) < prompt_len + 1:
        raise DistillConfigError(f"the training pool holds {len(pool)} tokens, too few to cut prompts from")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(pool) - prompt_len, (n,), generator=gen)
    prompts = pool[starts[:, None] + torch.arange(prompt_len)]
    batches = prompts.split(batch_size)
    device = next(teacher.parameters()).device
    return torch.cat([teacher.generate(b.to(device), seq_len - prompt_len, generator=gen).cpu()
                      for b in track(batches, "distill: teacher writes sequences", total=len(batches))])
