"""The deployment targets: each backend registers one ``Target``, what it can run and how to lower to it.

What it can run: ``check(module, fmt)`` returns ``None`` when the target runs a module stored in
format ``fmt`` (the manifest's per-module entry, e.g. ``{"format": "int4", "group_size": 64}``) or
a reason when it cannot. Pipeline validation and ``qcompile lower`` both use it, so an impossible
combination fails before compiling. A target may also declare ``check_plan(plan)`` for what no
single module entry shows: the model dtype, several modules together, an FP8 KV cache (a
``DeploymentPlan``, built from a pipeline before it runs or from an artifact's manifest).

How to lower: ``lower(artifact, out, options, force)`` writes the target's output and returns a
``LowerResult`` (where it wrote, and notes for the user); ``Options`` is the frozen dataclass of
the options it takes (fields declared with ``compiler.options.option``, so each carries its help
text). ``qcompile lower`` builds its flags from them and prints the result's notes, so a new
backend adds a target without touching the command line (``compiler/deploy/lowering.py``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from compiler.errors import ConfigError
from compiler.options import suggest


@dataclass(frozen=True)
class DeploymentPlan:
    """What a target is asked to run: the model dtype, every converted module's format entry, the
    passes with their options (a pipeline's, before it runs), the manifest's KV cache and serving
    plan (an artifact's) and the model's config."""

    dtype: str
    formats: dict[str, dict]
    passes: list[tuple[str, Any]] = field(default_factory=list)
    kv_cache: dict | None = None
    config: Any = None  # the model's ModelConfig, for targets that run some architectures only
    serving: dict | None = None  # the manifest's "serving" entry (the paged_kv pass's resolved plan)


def planned_kv_cache(plan: DeploymentPlan) -> dict | None:
    """The KV-cache entry ``plan`` declares (``dtype``, ``granularity``; an artifact's has its scales too):
    the manifest's, or the one a pipeline's pass will write (its ``kv_cache_dtype``)."""
    kv = plan.kv_cache
    for _, options in plan.passes:
        if getattr(options, "kv_cache_dtype", "none") != "none":
            kv = {"dtype": options.kv_cache_dtype, "granularity": options.kv_cache_granularity}
    return kv


@dataclass
class LowerResult:
    """What a lowering wrote (``path``) and what its user should know: ``notes`` (what was rounded,
    what was not written and why) and ``layers``, how many layers were written each way, for the
    targets that say (the ONNX and Ascend bundles)."""

    path: Path
    notes: list[str] = field(default_factory=list)
    layers: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class NoOptions:
    pass


@dataclass(frozen=True)
class Target:
    """A deployment target: what it runs (``check``, ``check_plan``) and how to lower to it (``lower``
    taking an ``Options`` instance: ``lower(artifact_dir, out, options, force) -> LowerResult``)."""

    name: str
    description: str
    check: Callable[[str, dict], str | None]
    lower: Callable[[Path, Path, Any, bool], LowerResult]
    Options: type = NoOptions
    check_plan: Callable[[DeploymentPlan], str | None] | None = None

    def option_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.Options)]


TARGETS: dict[str, Target] = {}


def register_target(target: Target) -> Target:
    if not dataclasses.is_dataclass(target.Options):
        raise TypeError(f"target {target.name!r}: Options must be a dataclass, got {target.Options!r}")
    TARGETS[target.name] = target
    return target


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise ConfigError(f"unknown target {name!r}{suggest(name, TARGETS)}")
    return TARGETS[name]


def check_formats(target: str, formats: dict[str, dict], where: str = "") -> None:
    """Raise ConfigError listing every module the target cannot run."""
    spec = get_target(target)
    by_reason: dict[str, list[str]] = {}  # one reason, said once, for every module it stops
    for module, fmt in formats.items():
        if why := spec.check(module, fmt):
            by_reason.setdefault(why, []).append(module)
    if by_reason:
        problems = [f"{modules[0]}{f' (and {len(modules) - 1} more layers)' if len(modules) > 1 else ''}: {why}"
                    for why, modules in by_reason.items()]
        more = f" (+{len(problems) - 3} more reasons)" if len(problems) > 3 else ""
        prefix = f"{where}: " if where else ""
        raise ConfigError(f"{prefix}target {target!r} cannot run {'; '.join(problems[:3])}{more}")


def check_plan(target: str, plan: DeploymentPlan, where: str = "") -> None:
    """Raise ConfigError when ``target`` cannot run ``plan`` as a whole (its own ``check_plan``)."""
    spec = get_target(target)
    why = spec.check_plan(plan) if spec.check_plan else None
    if why:
        prefix = f"{where}: " if where else ""
        raise ConfigError(f"{prefix}target {target!r} cannot run {why}")
