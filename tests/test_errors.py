"""One error hierarchy: every exception class qcompile's packages define derives from
``compiler.errors.QCompileError`` (which the CLI prints as one line), and no two share a name.

Every module is imported; one that needs a runtime this host lacks (Triton's Python backend,
torch_npu, …) is imported against a stand-in for it, so its classes are checked too.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
import types
from collections import Counter
from unittest import mock

import pytest

from compiler.errors import QCompileError
from serving.adapters.triton_common import TritonRequestError

PACKAGES = ("calib", "compiler", "passes", "backends", "serving", "qcompile")


class _StandIn(types.ModuleType):
    """A module this host does not have: any attribute is a mock, any submodule another stand-in."""

    __path__: list[str] = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return mock.MagicMock(name=f"{self.__name__}.{name}")


def module_names() -> list[str]:
    names = []
    for package in PACKAGES:
        root = importlib.import_module(package)
        names.append(package)
        names += [m.name for m in pkgutil.walk_packages(root.__path__, package + ".")
                  if not m.name.endswith("__main__")]  # __main__ runs the CLI
    return names


def import_with_stand_ins(name: str, stand_ins: dict) -> types.ModuleType:
    while True:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or e.name.partition(".")[0] in PACKAGES or e.name in stand_ins:
                raise
            stand_ins[e.name] = sys.modules[e.name] = _StandIn(e.name)


def error_classes() -> list[type]:
    """Every Exception subclass defined (not just imported) in qcompile's modules."""
    stand_ins: dict = {}
    before = set(sys.modules)
    found = []
    try:
        for name in module_names():
            module = import_with_stand_ins(name, stand_ins)
            found += [obj for obj in vars(module).values() if isinstance(obj, type) and issubclass(obj, Exception)
                      and obj.__module__ == name]
    finally:
        if stand_ins:  # what was imported against a stand-in goes, with the stand-ins
            for name in set(sys.modules) - before:
                if name in stand_ins or any(isinstance(v, _StandIn) for v in vars(sys.modules[name]).values()):
                    sys.modules.pop(name, None)
    return found


@pytest.fixture(scope="module")
def classes() -> list[type]:
    return error_classes()


def test_every_error_class_is_a_qcompile_error(classes):
    names = {f"{c.__module__}.{c.__qualname__}" for c in classes}
    assert {"calib.corpus.CorpusError", "serving.adapters.triton_common.TritonRequestError",
            "backends.ascend.atc.AtcNotFound"} <= names  # the walk reaches every layer
    outside = sorted(f"{c.__module__}.{c.__qualname__} ({', '.join(b.__name__ for b in c.__mro__[1:-2])})"
                     for c in classes if not issubclass(c, QCompileError))
    assert not outside, "error classes outside QCompileError: " + "; ".join(outside)


def test_no_two_error_classes_share_a_name(classes):
    """Two unrelated ``RequestError``s (one a QCompileError, one a ValueError) once caught each other's callers out."""
    shared = [name for name, n in Counter(c.__name__ for c in classes).items() if n > 1]
    assert not shared, f"error classes defined twice: {shared}"


def test_a_request_triton_refuses_is_one_line_at_the_cli(monkeypatch, capsys):
    """A bad request is the user's to fix: one line and exit 2, the traceback only with --debug."""
    import compiler.io.summary
    from qcompile.cli import _state, main

    def refuse(path):
        raise TritonRequestError("max_tokens must be in [1, 256], got 1000")

    monkeypatch.setattr(compiler.io.summary, "artifact_summary", refuse)
    monkeypatch.setitem(_state, "debug", False)
    monkeypatch.setattr(sys, "argv", ["qcompile", "inspect", "somewhere"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err == "error: max_tokens must be in [1, 256], got 1000\n"
    monkeypatch.setattr(sys, "argv", ["qcompile", "--debug", "inspect", "somewhere"])
    with pytest.raises(TritonRequestError):
        main()
