"""Lowering an artifact to a deployment target (``qcompile lower ARTIFACT --target T -o OUT``).

Backends register one function per target with ``register_lowering``; it receives the artifact
directory, the output path, the target's options (a dict from the command line, parsed by the
backend into its own options dataclass) and ``force``, and returns what it wrote.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from compiler.errors import ConfigError
from compiler.options import suggest

Lowering = Callable[[Path, Path, dict, bool], Path]
LOWERINGS: dict[str, Lowering] = {}


def register_lowering(target: str, fn: Lowering) -> Lowering:
    LOWERINGS[target] = fn
    return fn


def lower(artifact: str | Path, target: str, out: str | Path, options: dict | None = None, force: bool = False) -> Path:
    """Lower ``artifact`` for ``target`` into ``out``; unknown targets are a ConfigError naming the known ones."""
    if target not in LOWERINGS:
        raise ConfigError(f"no lowering for target {target!r}{suggest(target, LOWERINGS)}")
    return LOWERINGS[target](Path(artifact), Path(out), dict(options or {}), force)


DEFAULT_MAX_LEN = 1024


def load_for_target(artifact: Path, target: str, max_len: int | None):
    """The artifact, checked against ``target``'s constraints, and the KV-cache length to lower with."""
    from compiler.deploy.targets import check_formats
    from compiler.io.artifact import load_artifact

    loaded = load_artifact(artifact)
    check_formats(target, loaded.manifest.get("modules", {}), str(artifact))
    return loaded, max_len or min(DEFAULT_MAX_LEN, loaded.model.config.max_seq_len)
