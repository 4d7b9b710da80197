"""Which modules a pass leaves alone: ``modules_to_not_convert``, one meaning for every pass.

A pattern names module ``name`` when it matches, as a case-sensitive glob (``fnmatch``: ``*``,
``?``, ``[...]``), a run of whole dotted components of ``name``: the full name, or any part of it
that starts and ends at a dot. Naming a module therefore names everything under it, as
llm-compressor's ``ignore`` and vLLM's skipped prefixes read::

    "lm_head"                  lm_head
    "self_attn"                every Linear of every attention block
    "layers.0"                 every module of block 0 (not of block 10)
    "layers.*.mlp.down_proj"   every block's down_proj
    "layers.1*"                blocks 1 and 10-19
    "*_proj"                   every projection

A pattern that names no module of the model is an error when the pipeline is validated (a typo
must not quietly convert the layer it meant to keep): ``check_patterns``.
"""
from __future__ import annotations

import difflib
from fnmatch import fnmatchcase

import torch
import torch.nn as nn

from compiler.errors import ConfigError
from compiler.formats.qlinear import linear_modules
from compiler.model.config import ModelConfig
from compiler.model.transformer import Transformer


def meta_model(config: ModelConfig) -> Transformer:
    """The decoder of ``config`` on the meta device: its module names and shapes, no memory."""
    with torch.device("meta"):
        return Transformer(config)


def _runs(name: str) -> list[str]:
    """Every run of whole dotted components of ``name``: 'a.b' -> ['a', 'a.b', 'b']."""
    parts = name.split(".")
    return [".".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)]


def matches(name: str, pattern: str) -> bool:
    """Whether ``pattern`` names module ``name`` (see the module docstring)."""
    return any(fnmatchcase(run, pattern) for run in _runs(name))


def excluded_by(name: str, patterns: list[str]) -> str | None:
    """The first of ``patterns`` that names module ``name``, or None."""
    return next((p for p in patterns if matches(name, p)), None)


def select_linears(model: nn.Module, patterns: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the float Linears no pattern names, {each excluded Linear: the pattern naming it}), in module order."""
    selected, excluded = [], {}
    for name in linear_modules(model):
        if (p := excluded_by(name, patterns)) is None:
            selected.append(name)
        else:
            excluded[name] = p
    return selected, excluded


def check_patterns(patterns: list[str], model: nn.Module) -> None:
    """Raise ``ConfigError`` (one line) on the first pattern that names no module of ``model``."""
    names = [n for n, _ in model.named_modules() if n]
    for p in patterns:
        if any(matches(n, p) for n in names):
            continue
        runs = sorted({r for n in names for r in _runs(n)})
        close = difflib.get_close_matches(p, runs, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        example = next(iter(linear_modules(model)), names[-1])
        raise ConfigError(f"modules_to_not_convert pattern {p!r} matches no module ({hint}names look like "
                          f"{example!r}); fix or remove it")
