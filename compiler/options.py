"""Typed options from TOML tables: dataclasses that reject unknown keys and wrong types.

``parse_options(Cls, table, where)`` builds ``Cls(**table)`` after checking every key against
the dataclass fields (suggesting the nearest one for a typo) and every value against its type.
Dataclasses add their own range checks in ``__post_init__`` by raising ``ValueError``.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union

from compiler.errors import ConfigError


def suggest(name: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(sorted(choices))}"


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin in (list, tuple):
        (item,) = typing.get_args(tp)[:1] or (Any,)
        return isinstance(value, (list, tuple)) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def parse_options(cls: type, table: dict | None, where: str):
    """Build the options dataclass ``cls`` from a TOML table; ``where`` names it in errors."""
    table = dict(table or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    for key, value in table.items():
        if key not in fields:
            raise ConfigError(f"{where}: unknown option {key!r}{suggest(key, fields)}")
        if not _type_ok(value, hints[key]):
            raise ConfigError(f"{where}: option {key!r} must be {_type_name(hints[key])}, got {value!r}")
    try:
        return cls(**table)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from None


def options_to_dict(options) -> dict:
    return dataclasses.asdict(options)


def option(default: Any = dataclasses.MISSING, help: str = "", *, default_factory: Any = dataclasses.MISSING,
           flag: str | None = None, cli: bool = True) -> Any:
    """A dataclass field with its help text, read by the command line that builds its flags from the
    dataclass (``qcompile/cli/options.py``): ``--field-name`` unless ``flag`` names it otherwise;
    ``cli=False`` keeps a field out of the command line (say why in ``help``)."""
    metadata = {"help": help, "flag": flag, "cli": cli}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def split_list(text: str) -> list[str]:
    """``"a, b,c"`` -> ``["a", "b", "c"]``: how every comma list (a flag, a spec) is read; empty items drop."""
    return [item.strip() for item in text.split(",") if item.strip()]
