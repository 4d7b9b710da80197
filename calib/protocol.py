"""The shared data protocol, so that figures compare across tools.

Tokenize the whole corpus once. Tokens [0, 70%) are the calibration pool, [70%, 85%) the
evaluation region, [85%, 100%) the validation region. Calibration draws ``samples`` windows of
``seq_len`` tokens from the pool (seeded); perplexity uses non-overlapping windows of
``eval_len`` tokens from the start of a region.

Reported figures are measured on the evaluation region. Choices — an option's default, a grid,
a threshold — are made on the validation region, so no reported figure is one a choice was fit
to. The two never overlap.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

CALIBRATION_FRACTION = 0.7
VALIDATION_FRACTION = 0.15  # the corpus's last 15%
SPLITS = ("evaluation", "validation")


@dataclass(frozen=True)
class CalibrationConfig:
    """The ``[calibration]`` table of a pipeline file."""

    corpus: str = "pydoc"
    samples: int = 128
    seq_len: int = 512
    seed: int = 0

    def __post_init__(self):
        if self.samples < 1:
            raise ValueError(f"calibration.samples must be >= 1, got {self.samples}")
        if self.seq_len < 2:
            raise ValueError(f"calibration.seq_len must be >= 2, got {self.seq_len}")


@dataclass(frozen=True)
class TokenSplit:
    pool: torch.Tensor  # [N_pool] calibration/training tokens
    evaluation: torch.Tensor  # [N_eval] held-out tokens whose figures are reported
    validation: torch.Tensor  # [N_val] held-out tokens that choices are made on

    def region(self, split: str) -> torch.Tensor:
        """The held-out tokens of ``split`` ("evaluation" or "validation")."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
        return self.evaluation if split == "evaluation" else self.validation


def split_tokens(token_ids: torch.Tensor | list[int]) -> TokenSplit:
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    cut = int(len(ids) * CALIBRATION_FRACTION)
    val = int(len(ids) * (1 - VALIDATION_FRACTION))
    return TokenSplit(pool=ids[:cut], evaluation=ids[cut:val], validation=ids[val:])


def calibration_windows(pool: torch.Tensor | list[torch.Tensor], samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """``samples`` windows of ``seq_len`` tokens drawn from the pool with a seeded generator -> [samples, seq_len].
    Several pools (a mixture of corpora): an equal share from each, the first ones taking the remainder."""
    pools = [pool] if isinstance(pool, torch.Tensor) else list(pool)
    shares = [samples // len(pools) + (i < samples % len(pools)) for i in range(len(pools))]
    return torch.cat([_windows(p, n, seq_len, seed) for p, n in zip(pools, shares) if n])


def _windows(pool: torch.Tensor, samples: int, seq_len: int, seed: int) -> torch.Tensor:
    if len(pool) < seq_len:
        raise ValueError(f"calibration pool has {len(pool)} tokens, fewer than seq_len={seq_len}; use a larger corpus or a shorter seq_len")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(pool) - seq_len + 1, (samples,), generator=gen)
    return torch.stack([pool[s : s + seq_len] for s in starts.tolist()])


def evaluation_windows(evaluation: torch.Tensor, windows: int, eval_len: int = 512) -> torch.Tensor:
    """The first ``windows`` non-overlapping windows of ``eval_len`` tokens -> [windows, eval_len]."""
    available = len(evaluation) // eval_len
    if available < windows:
        raise ValueError(f"evaluation region holds {available} windows of {eval_len} tokens, fewer than the {windows} asked for")
    return evaluation[: windows * eval_len].view(windows, eval_len)
