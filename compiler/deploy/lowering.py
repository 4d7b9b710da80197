"""Lowering an artifact to a deployment target (``qcompile lower ARTIFACT --target T -o OUT``).

Each backend registers one ``Lowering`` per target with ``register_lowering``: the function that
writes the target's bundle, and the frozen dataclass of the options it takes (fields declared with
``compiler.options.option``, so each carries its help text). ``lower`` parses the caller's options
against that dataclass — an option the target does not take is an error naming the target and the
ones it does — and ``qcompile lower`` builds its flags from the registered dataclasses, so a new
backend adds its flags without touching the command line.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from compiler.errors import ConfigError
from compiler.options import parse_options, suggest


@dataclass(frozen=True)
class NoLowerOptions:
    pass


@dataclass(frozen=True)
class Lowering:
    """``run(artifact_dir, out, options, force) -> what it wrote``; ``options`` is an ``Options`` instance."""

    target: str
    run: Callable[[Path, Path, Any, bool], Path]
    Options: type = NoLowerOptions

    def option_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.Options)]


LOWERINGS: dict[str, Lowering] = {}


def register_lowering(target: str, run: Callable[[Path, Path, Any, bool], Path], options: type = NoLowerOptions) -> Lowering:
    """Register ``run`` as the lowering for ``target``, taking the options dataclass ``options``."""
    if not dataclasses.is_dataclass(options):
        raise TypeError(f"lowering {target!r}: options must be a dataclass, got {options!r}")
    LOWERINGS[target] = Lowering(target, run, options)
    return LOWERINGS[target]


def get_lowering(target: str) -> Lowering:
    if target not in LOWERINGS:
        raise ConfigError(f"no lowering for target {target!r}{suggest(target, LOWERINGS)}")
    return LOWERINGS[target]


def lower(artifact: str | Path, target: str, out: str | Path, options: dict | Any = None, force: bool = False) -> Path:
    """Lower ``artifact`` for ``target`` into ``out``. ``options``: a dict of the target's options
    (or its options dataclass); unknown targets and options are a ConfigError naming the valid ones."""
    lowering = get_lowering(target)
    if not isinstance(options, lowering.Options):
        options = parse_options(lowering.Options, options, f"lower target {target!r}")
    return lowering.run(Path(artifact), Path(out), options, force)


DEFAULT_MAX_LEN = 1024


def load_for_target(artifact: Path, target: str, max_len: int | None):
    """The artifact, checked against ``target``'s constraints, and the KV-cache length to lower with."""
    from compiler.deploy.targets import check_formats
    from compiler.io.artifact import load_artifact

    loaded = load_artifact(artifact)
    check_formats(target, loaded.manifest.get("modules", {}), str(artifact))
    return loaded, max_len or min(DEFAULT_MAX_LEN, loaded.model.config.max_seq_len)
