"""Lowering an artifact to a deployment target (``qcompile lower ARTIFACT --target T -o OUT``).

``lower`` finds the target in the registry (``compiler/deploy/targets.py``), parses the caller's
options against its options dataclass — an option the target does not take is an error naming the
target and the ones it does — and runs its ``lower``, which returns a ``LowerResult``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from compiler.deploy.targets import LowerResult, check_formats, get_target
from compiler.options import parse_options


def lower(artifact: str | Path, target: str, out: str | Path, options: dict | Any = None, force: bool = False) -> LowerResult:
    """Lower ``artifact`` for ``target`` into ``out``. ``options``: a dict of the target's options
    (or its options dataclass); unknown targets and options are a ConfigError naming the valid ones."""
    spec = get_target(target)
    if not isinstance(options, spec.Options):
        options = parse_options(spec.Options, options, f"lower target {target!r}")
    return spec.lower(Path(artifact), Path(out), options, force)


DEFAULT_MAX_LEN = 1024


def load_for_target(artifact: Path, target: str, max_len: int | None):
    """The artifact, checked against ``target``'s constraints, and the KV-cache length to lower with."""
    from compiler.io.artifact import load_artifact

    loaded = load_artifact(artifact)
    check_formats(target, loaded.manifest.modules, str(artifact))
    return loaded, max_len or min(DEFAULT_MAX_LEN, loaded.model.config.max_seq_len)
