"""Calibration and evaluation data: corpora, the split protocol, perplexity.

Below ``compiler/``: of the rest of qcompile it imports ``compiler.errors`` alone (its errors are
``ConfigError``s, which the CLI prints as one line).
"""
from calib.corpus import CorpusError, corpus_parts, load_corpus_text
from calib.perplexity import perplexity
from calib.protocol import (
    SPLITS,
    CalibrationConfig,
    TokenSplit,
    calibration_windows,
    evaluation_windows,
    split_tokens,
)

__all__ = [
    "CorpusError",
    "corpus_parts",
    "load_corpus_text",
    "SPLITS",
    "CalibrationConfig",
    "TokenSplit",
    "split_tokens",
    "calibration_windows",
    "evaluation_windows",
    "perplexity",
]
