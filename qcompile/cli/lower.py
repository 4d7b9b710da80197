"""``qcompile lower ARTIFACT --target T -o DIR``: one command for every target.

Each backend registers its target (``compiler.deploy.targets.register_target``) with the dataclass
of its lowering's options; this command's target flags are the union of those fields
(``--max-len``, ``--soc``, ``--device`` …, each help naming the targets that take it), and it
prints what the lowering returns (its layer table and notes), so a new backend adds its flags and
notes without touching this file. A flag that the chosen target does not take is an error naming
the target and the flags it does take, never silently ignored.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import typer
from rich.table import Table

from compiler.deploy.lowering import lower
from compiler.deploy.targets import TARGETS, LowerResult, get_target
from compiler.errors import ConfigError, LoweringIncomplete
from qcompile import load_plugins
from qcompile.cli.options import Flag, add_flags, dataclass_flags

load_plugins()  # the backends register their targets, whose lowering options become this command's flags


def target_flags() -> list[Flag]:
    """One flag per option name over every registered target; its help says which targets take it.
    Each flag defaults to unset, so only what is given reaches the target's dataclass."""
    merged: dict[str, Flag] = {}
    helps: dict[str, dict[str, list[str]]] = {}
    for target in sorted(TARGETS):
        options = TARGETS[target].Options
        defaults = {f.name: f.default for f in dataclasses.fields(options)}
        for flag in dataclass_flags(options):
            known = merged.setdefault(flag.name, flag)
            if (known.hint, known.decl) != (flag.hint, flag.decl):
                raise TypeError(f"lowering option {flag.name!r}: {target} declares {flag.hint} {flag.decl}, "
                                f"another target {known.hint} {known.decl}; give it one type and flag, or rename it")
            default = defaults[flag.name]
            text = flag.help + ("" if default in (None, dataclasses.MISSING) else f" (default {default})")
            helps.setdefault(flag.name, {}).setdefault(text, []).append(target)
    return [dataclasses.replace(f, default=None, help="; ".join(f"{', '.join(t)}: {h}" for h, t in helps[f.name].items()))
            for f in merged.values()]


FLAGS = target_flags()


@add_flags(FLAGS)
def lower_cmd(
    artifact: Path = typer.Argument(..., help="Artifact directory (from 'qcompile compile')."),
    target: str = typer.Option(..., "--target", "-t", help=f"Deployment target: {', '.join(sorted(TARGETS))}."),
    output: Path = typer.Option(..., "-o", "--output", help="What to write: a folder (bundle, Triton model repository, "
                                                            "vLLM checkpoint) or, for gguf, the .gguf file."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output folder."),
    *,
    options: dict,
):
    """Lower ARTIFACT to a deployable bundle for TARGET."""
    from qcompile.cli.console import out

    check_target_flags(target, options)
    try:
        result = lower(artifact, target, output, options, force)
    except LoweringIncomplete as e:  # written, but a last step is left to another host (the .om): show what it holds
        if e.lowered is not None:
            print_lowered(out, e.lowered)
        raise
    print_lowered(out, result)
    out.print(f"wrote [bold]{result.path}[/bold] (target {target})")


def check_target_flags(target: str, given: dict) -> None:
    """A one-line error for flags ``target`` does not take, naming the ones it does."""
    takes = get_target(target).option_names()
    decl = {f.name: f.decl for f in FLAGS}
    foreign = [decl[name] for name in given if name not in takes]
    if foreign:
        valid = ", ".join(decl[name] for name in takes if name in decl) or "none"
        raise ConfigError(f"--target {target} does not take {', '.join(foreign)}; its options: {valid}")


def print_lowered(console, result: LowerResult) -> None:
    """How many layers were written each way (the targets that say), then the target's notes."""
    if result.layers:
        table = Table(title="layers")
        table.add_column("exported as")
        table.add_column("layers", justify="right")
        for how, n in sorted(result.layers.items()):
            table.add_row(how, str(n))
        console.print(table)
    for note in result.notes:
        console.print(f"note: {note}")
