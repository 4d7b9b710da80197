"""Perplexity of a loaded model on a corpus by the shared protocol (see ``calib.protocol``), and
llama.cpp's KL-divergence statistics of a candidate against a reference on the same windows."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from calib import evaluation_windows, load_corpus_text, perplexity, split_tokens
from calib.kl_divergence import KLDivergence, LogitsReference, Reference, TopLogProbs, encode_compact
from compiler.errors import ConfigError, QCompileError
from compiler.io.kl_reference import ReferenceInfo, is_reference_file, read_reference, tokens_sha256, write_reference
from compiler.io.load import load_checkpoint
from compiler.io.types import LoadedModel

BATCH_SIZE = 4  # windows per forward, as ``calib.perplexity``


def corpus_split(tokenizer, corpus: str):
    if tokenizer is None:
        raise ConfigError("evaluation needs a tokenizer, and this model ships none; add tokenizer files to the checkpoint")
    text = load_corpus_text(corpus)
    return split_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])


def evaluation_batch(tokenizer, corpus: str = "pydoc", windows: int = 16, eval_len: int = 512,
                     split: str = "evaluation") -> torch.Tensor:
    """The first ``windows`` windows of ``eval_len`` tokens of ``corpus``'s ``split`` region -> [windows, eval_len]."""
    tokens = corpus_split(tokenizer, corpus)
    try:
        return evaluation_windows(tokens.region(split), windows, eval_len)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def evaluate_perplexity(loaded: LoadedModel, corpus: str = "pydoc", windows: int = 16, eval_len: int = 512,
                        split: str = "evaluation") -> dict:
    """``{"ppl", "tokens", "nll"}`` on the first ``windows`` windows of ``corpus``'s ``split`` region:
    "evaluation" for figures that are reported, "validation" for choosing settings."""
    batch = evaluation_batch(loaded.tokenizer, corpus, windows, eval_len, split)
    model = loaded.model
    with torch.inference_mode():
        return perplexity(model, batch.to(next(model.parameters()).device))


# -- KL divergence against a reference ---------------------------------------------------------


def load_reference(spec: str | Path, dtype: str = "float32", allow_pickle: bool = False) -> LoadedModel | Path:
    """A reference file (saved by ``compare_to_reference(..., save_reference=FILE)``) as its path,
    else the model ``load_checkpoint`` reads (a checkpoint, an artifact, a built-in name)."""
    if is_reference_file(spec):
        return Path(spec)
    return load_checkpoint(spec, dtype, allow_pickle)


def check_reference_options(reference: LoadedModel | str | Path | None, save_reference: Path | None,
                            plot: Path | None) -> None:
    """One-line errors for options that need a reference, or a reference model, before anything runs."""
    if reference is None:
        for value, flag in ((save_reference, "--save-reference"), (plot, "--plot")):
            if value is not None:
                raise ConfigError(f"{flag} needs a reference to compare with: add --reference MODEL (or a reference file)")
    elif save_reference is not None and not isinstance(reference, LoadedModel) and is_reference_file(reference):
        raise ConfigError(f"--save-reference writes a reference model's file, and {reference} is already a reference "
                          "file: give the model as --reference, or drop --save-reference")


def compare_to_reference(candidate: LoadedModel, reference: LoadedModel | str | Path, corpus: str = "pydoc",
                         windows: int = 16, split: str = "evaluation", save_reference: Path | None = None,
                         plot: Path | None = None, eval_len: int = 512) -> dict:
    """llama.cpp's KL-divergence statistics (``calib.kl_divergence``) of ``candidate`` against
    ``reference`` — a model (loaded, or anything ``load_reference`` reads), or a reference file saved
    earlier — on the windows ``evaluate_perplexity`` scores (tokens 1..T-1 of each window),
    ``BATCH_SIZE`` windows at a time. ``save_reference`` writes a reference model's file; ``plot``
    draws the histogram of per-token KLD to a PNG.
    Returns the statistics with corpus, split, windows, tokens, the reference as given and the
    reference model's path (the one a reference file was saved from)."""
    check_reference_options(reference, save_reference, plot)
    windowed = reference_windows(candidate, reference, corpus, windows, split, eval_len)
    stats = score_windows(windowed, {"candidate": lambda batch: scored_logits(candidate, batch)}, save_reference)["candidate"]
    result = {**stats.result(), **windowed.describe()}
    if plot is not None:
        plot_kld_histogram(stats.token_kld(), plot, f"per-token KL divergence of {Path(candidate.source.path).name} "
                                                    f"against {Path(windowed.model_name).name} ({result['tokens']} tokens)")
    return result


Scorer = Callable[[torch.Tensor], "torch.Tensor | TopLogProbs"]
"""A candidate runtime: for windows [B, T], its next-token distributions at tokens 1..T-1 of each
window, window by window — logits [B·(T-1), V], or ``TopLogProbs`` where it returns only some tokens'."""


@dataclass
class ReferenceWindows:
    """The evaluation windows and the reference's distributions on them, checked to be comparable."""

    batch: torch.Tensor  # [windows, eval_len] token ids
    corpus: str
    split: str
    name: str  # the reference as given
    model_name: str  # the reference model's path (the one a reference file was saved from)
    info: ReferenceInfo
    references: Iterator[Reference]  # one per BATCH_SIZE windows, read (or computed) as they are scored

    def describe(self) -> dict:
        return {"corpus": self.corpus, "split": self.split, "windows": len(self.batch), "reference": self.name,
                "reference_model": self.model_name}


def reference_windows(candidate: LoadedModel, reference: LoadedModel | str | Path, corpus: str = "pydoc",
                      windows: int = 16, split: str = "evaluation", eval_len: int = 512) -> ReferenceWindows:
    """The windows of ``candidate``'s tokenizer and ``reference`` on them (a model, or a reference file
    checked against the windows), before any candidate runs: a mismatch is one line, at once."""
    if not isinstance(reference, LoadedModel):
        reference = load_reference(reference)
    batch = evaluation_batch(candidate.tokenizer, corpus, windows, eval_len, split)
    vocab_size = candidate.model.config.vocab_size
    if isinstance(reference, LoadedModel):
        _check_comparable(reference, batch, vocab_size, corpus, split)
        name = model_name = reference.source.path
        references = _model_references(reference, batch)
    else:
        reference_file = read_reference(reference)
        reference_file.check_matches(batch, vocab_size, corpus, split)
        name, model_name = str(reference), reference_file.info.reference
        references = (reference_file.positions(start, min(start + BATCH_SIZE, windows))
                      for start in range(0, windows, BATCH_SIZE))
    info = ReferenceInfo(corpus, split, windows, eval_len, vocab_size, model_name, tokens_sha256(batch))
    return ReferenceWindows(batch, corpus, split, name, model_name, info, references)


def score_windows(windowed: ReferenceWindows, scorers: dict[str, Scorer], save_reference: Path | None = None,
                  failures: dict[str, str] | None = None) -> dict[str, KLDivergence]:
    """Each scorer's statistics against the reference on the same windows, ``BATCH_SIZE`` windows at a
    time, the reference read (or run) once per batch for all of them. ``save_reference`` writes the
    reference's file on the way. With ``failures``, a scorer that fails (a ``QCompileError``, or
    non-finite output) is dropped with its message there and the others go on; without, it raises."""
    stats = {name: KLDivergence() for name in scorers}
    live = dict(scorers)
    batch = windowed.batch
    with _writer(save_reference, windowed.info, batch) as writer:
        for start, ref in zip(range(0, len(batch), BATCH_SIZE), windowed.references):
            windows_batch = batch[start:start + BATCH_SIZE]
            if writer is not None:
                writer.append(encode_compact(ref.logits, ref.targets))
            for name, score in list(live.items()):
                try:
                    stats[name].add(ref, score(windows_batch), windows_batch[:, 1:].reshape(-1))
                except (QCompileError, FloatingPointError) as e:
                    if failures is None:
                        raise
                    failures[name] = str(e)
                    del live[name]
    return {name: stats[name] for name in live}


def _check_comparable(reference: LoadedModel, batch: torch.Tensor, vocab_size: int, corpus: str, split: str) -> None:
    if reference.model.config.vocab_size != vocab_size:
        raise ConfigError(f"the reference has a vocabulary of {reference.model.config.vocab_size} tokens, the candidate "
                          f"{vocab_size}: compare models that share a tokenizer")
    if reference.tokenizer is not None:  # without one, the candidate's tokens are the reference's too
        theirs = evaluation_batch(reference.tokenizer, corpus, batch.shape[0], batch.shape[1], split)
        if not torch.equal(theirs, batch):
            raise ConfigError(f"the reference's tokenizer splits {corpus!r} into other tokens than the candidate's: "
                              "compare models that share a tokenizer")


def scored_logits(loaded: LoadedModel, windows: torch.Tensor) -> torch.Tensor:
    """The logits that predict tokens 1..T-1 of each window -> [B · (T-1), V] float32."""
    model = loaded.model
    with torch.inference_mode():
        logits = model(windows.to(next(model.parameters()).device)).float()
    return logits[:, :-1].reshape(-1, logits.shape[-1])


def _model_references(reference: LoadedModel, batch: torch.Tensor) -> Iterator[Reference]:
    for start in range(0, len(batch), BATCH_SIZE):
        windows = batch[start:start + BATCH_SIZE]
        yield LogitsReference(scored_logits(reference, windows), windows[:, 1:].reshape(-1))


@contextlib.contextmanager
def _writer(path: Path | None, info: ReferenceInfo, batch: torch.Tensor):
    if path is None:
        yield None
    else:
        with write_reference(path, info, batch) as writer:
            yield writer


def plot_kld_histogram(token_kld: np.ndarray, path: str | Path, title: str) -> Path:
    """A histogram of per-token KLD on a log-scaled x axis; values below its first edge (0 and
    rounding's tiny negatives among them) are counted in the first bin."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    path = Path(path)
    positive = token_kld[token_kld > 0]
    low = max(float(positive.min()), 1e-8) if positive.size else 1e-8
    high = max(float(token_kld.max()), low * 10)
    bins = np.logspace(math.log10(low), math.log10(high), 61)
    below = int((token_kld < low).sum())
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(np.clip(token_kld, low, high), bins=bins)
    ax.set_xscale("log")
    note = f"; {below} below {low:.1e} counted in the first bin" if below else ""
    ax.set(xlabel=f"KL divergence per token (nats{note})", ylabel="tokens", title=title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return path
