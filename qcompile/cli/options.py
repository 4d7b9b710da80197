"""What a flag means in every subcommand, and flags built from options dataclasses.

Conventions (README, "Command line"):

    --json              print the result as one JSON object on stdout, instead of the tables
    --output-json PATH  also write that JSON object to PATH
    --device D          the compute device: cpu, cuda or npu
    a list              a comma list, and the flag may be repeated: --heldout a,b --heldout c
                        (generate --stop is only repeated: a stop string may hold a comma)
    -o / --output       the folder (or file) the command writes; --force replaces it

Options that a pass or a backend declares are dataclass fields, and their flags are built from
those fields (``dataclass_flags``): field ``seq_len`` is ``--seq-len`` (or the ``flag`` its
``compiler.options.option`` names), with the field's type, default and help text, so a new option
is declared once, where it is used.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import typer

from compiler.errors import ConfigError
from compiler.options import split_list

COMPUTE_DEVICES = ("cpu", "cuda", "npu")


# -- --json and --output-json -------------------------------------------------------------------


def json_option() -> Any:
    return typer.Option(False, "--json", help="Print the result as one JSON object on stdout, instead of the tables.")


def output_json_option() -> Any:
    return typer.Option(None, "--output-json", dir_okay=False, help="Also write the result as JSON to this file.")


def emit(result: dict, as_json: bool, output_json: Path | None, show: Callable[[], None]) -> None:
    """The result as JSON on stdout (``--json``) or through ``show`` (tables), and into ``--output-json``."""
    from compiler.io.atomic import atomic_write_text
    from qcompile.cli.console import err, out

    if as_json:
        print(json.dumps(result, allow_nan=False))
    else:
        show()
    if output_json is not None:
        atomic_write_text(output_json, json.dumps(result, indent=1, allow_nan=False) + "\n")
        (err if as_json else out).print(f"wrote {output_json}")


# -- --device ----------------------------------------------------------------------------------


def device_option(default: str | None = None, use: str = "") -> Any:
    return typer.Option(default, "--device", help=f"Compute device: {', '.join(COMPUTE_DEVICES)}{use}.")


def check_device(device: str | None) -> str | None:
    """``device`` as given (``cuda:1`` included), or an error naming the devices. ``npu`` registers
    itself with torch through ``torch_npu``, imported here."""
    kind = None if device is None else device.partition(":")[0]
    if kind is not None and kind not in COMPUTE_DEVICES:
        raise ConfigError(f"--device {device!r}: use one of {', '.join(COMPUTE_DEVICES)}")
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            raise ConfigError("--device npu needs torch_npu (Ascend's PyTorch plug-in); install it, or use cpu or cuda") from None
    return device


# -- lists -------------------------------------------------------------------------------------


def parse_list(values: str | list[str] | tuple[str, ...] | None, cast: type, flag: str) -> list:
    """Every value of a list flag: comma lists, repeated flags, or both, each item cast to ``cast``."""
    if values is None:
        return []
    items = [item for v in ([values] if isinstance(values, str) else values) for item in split_list(v)]
    try:
        return [cast(item) for item in items]
    except ValueError:
        raise ConfigError(f"{flag} {','.join(items)!r}: give a comma list of {cast.__name__} values") from None


# -- flags from a dataclass --------------------------------------------------------------------


@dataclass(frozen=True)
class Flag:
    """One command-line flag for the dataclass field ``name``."""

    name: str
    decl: str  # "--seq-len"
    hint: Any  # the field's type
    default: Any  # the field's default (``None`` where the flag must be given to count)
    help: str


def dataclass_flags(cls: type, exclude: tuple[str, ...] = ()) -> list[Flag]:
    """A flag per field of ``cls`` except ``exclude`` and fields marked ``option(cli=False)``."""
    hints = typing.get_type_hints(cls)
    flags = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name in exclude or not f.metadata.get("cli", True):
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = ...
        decl = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        _cli_type(hints[f.name], f"{cls.__name__}.{f.name}")  # an unsupported type fails here, at import
        flags.append(Flag(f.name, decl, hints[f.name], default, f.metadata.get("help", "")))
    return flags


def add_flags(flags: list[Flag]) -> Callable[[Callable], Callable]:
    """Give a typer command one option per flag; it receives their values as ``options`` (a dict by
    field name, lists split and cast; a flag whose default is ``None`` is left out unless given)."""

    def decorate(fn: Callable) -> Callable:
        own = [p for p in inspect.signature(fn).parameters.values() if p.name != "options"]
        clash = {p.name for p in own} & {f.name for f in flags}
        if clash:
            raise TypeError(f"{fn.__name__}: flags {sorted(clash)} clash with the command's own parameters")

        @functools.wraps(fn)
        def command(**kwargs):
            options = {}
            for f in flags:
                value = _from_cli(kwargs.pop(f.name), f)
                if value is not None or f.default is not None:
                    options[f.name] = value
            return fn(**kwargs, options=options)

        generated = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=_cli_type(f.hint, f.name),
                                       default=_typer_option(f)) for f in flags]
        command.__signature__ = inspect.Signature(own + generated)
        return command

    return decorate


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def _list_item(hint: Any) -> type | None:
    inner, _ = _unwrap_optional(hint)
    if typing.get_origin(inner) in (list, tuple):
        return (typing.get_args(inner) or (str,))[0]
    return None


def _cli_type(hint: Any, where: str) -> Any:
    """The type typer parses for a field: list fields arrive as strings (comma lists, repeatable)."""
    item = _list_item(hint)
    if item is not None:
        if item not in (str, int, float):
            raise TypeError(f"{where}: a list of {item} has no flag form; mark the field option(..., cli=False)")
        return list[str]
    inner, _ = _unwrap_optional(hint)
    if inner in (str, int, float, bool) or typing.get_origin(inner) is Literal:
        return Optional[inner]
    raise TypeError(f"{where}: type {hint} has no flag form; mark the field option(..., cli=False)")


def _typer_option(f: Flag) -> Any:
    inner, _ = _unwrap_optional(f.hint)
    decl = f.decl
    if inner is bool and f.default is not False:  # a flag that can be switched off, or left unset
        decl = f"{f.decl}/--no-{f.decl.removeprefix('--')}"
    default = ([] if f.default is None else list(f.default)) if _list_item(f.hint) else f.default
    return typer.Option(default, decl, help=f.help, show_default=f.default not in (None, [], ...))


def _from_cli(value: Any, f: Flag) -> Any:
    item = _list_item(f.hint)
    if item is None:
        return value
    values = parse_list(value, item, f.decl)
    return None if not values and f.default is None else values
