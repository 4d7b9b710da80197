"""Perplexity of a loaded model on a corpus by the shared protocol (see ``calib.protocol``)."""
from __future__ import annotations

import torch

from calib import evaluation_windows, load_corpus_text, perplexity, split_tokens
from compiler.errors import ConfigError
from compiler.io.types import LoadedModel


def corpus_split(tokenizer, corpus: str):
    if tokenizer is None:
        raise ConfigError("evaluation needs a tokenizer, and this model ships none; add tokenizer files to the checkpoint")
    text = load_corpus_text(corpus)
    return split_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])


def evaluate_perplexity(loaded: LoadedModel, corpus: str = "pydoc", windows: int = 16, eval_len: int = 512,
                        split: str = "evaluation") -> dict:
    """``{"ppl", "tokens", "nll"}`` on the first ``windows`` windows of ``corpus``'s ``split`` region:
    "evaluation" for figures that are reported, "validation" for choosing settings."""
    tokens = corpus_split(loaded.tokenizer, corpus)
    try:
        batch = evaluation_windows(tokens.region(split), windows, eval_len)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model = loaded.model
    with torch.inference_mode():
        return perplexity(model, batch.to(next(model.parameters()).device))
