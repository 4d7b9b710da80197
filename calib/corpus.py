"""Text sources for calibration, evaluation and distillation.

A corpus spec is one string:
  - ``pydoc``: Python's ``pydoc_data.topics`` (keys sorted, texts joined by blank lines): the
    language reference, the corpus every figure is measured on;
  - ``stdlib-docs``: the docstrings of 35 standard-library modules (API documentation, a second
    domain; the held-out corpus of the quality figures). Both ship with every CPython, so nothing
    is downloaded;
  - a ``.txt`` file; a folder of ``.txt`` files (sorted by name, joined by blank lines);
  - a ``.jsonl`` file, optionally as ``file.jsonl:field`` (default field ``text``).

For calibration, ``a+b`` mixes corpora: each is split by the protocol on its own, and the
calibration windows are drawn in equal shares from their pools (``calib.protocol``).
"""
from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

from compiler.errors import ConfigError

BUILTIN_CORPORA = ("pydoc", "stdlib-docs")
STDLIB_MODULES = ("argparse", "asyncio.events", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
                  "datetime", "decimal", "email.message", "functools", "heapq", "http.client", "inspect", "itertools",
                  "json", "logging", "multiprocessing.pool", "os", "pathlib", "pickle", "re", "shutil", "socket",
                  "sqlite3", "statistics", "string", "subprocess", "tarfile", "threading", "typing", "unittest.case",
                  "urllib.parse", "uuid", "zipfile")


class CorpusError(ConfigError):
    """A corpus spec that names nothing readable."""


def _pydoc_text() -> str:
    from pydoc_data import topics

    return "\n\n".join(topics.topics[key] for key in sorted(topics.topics))


def docstring_text(modules: tuple[str, ...]) -> str:
    """Module, class and function docstrings of ``modules`` (those each defines), joined by blank lines.
    ``stdlib-docs`` is this rule on STDLIB_MODULES, unchanged since its first recorded figure."""
    parts = []
    for name in modules:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr, obj in sorted(vars(module).items()):
            if not attr.startswith("_") and getattr(obj, "__module__", None) == name and (inspect.isclass(obj) or inspect.isfunction(obj)):
                doc = inspect.getdoc(obj)
                if doc:
                    parts.append(f"{attr}\n{doc}")
    return "\n\n".join(p for p in parts if p)


def _jsonl_text(path: Path, field: str) -> str:
    texts = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{line_no}: not valid JSON ({e.msg}); each line must be one JSON object") from None
            if not isinstance(record, dict) or field not in record:
                raise CorpusError(f"{path}:{line_no}: no field {field!r}; name the text field as '{path}:FIELD'")
            texts.append(str(record[field]))
    return "\n\n".join(texts)


def corpus_parts(spec: str) -> list[str]:
    """The corpora a calibration spec mixes: ``pydoc+stdlib-docs`` -> both; an existing path
    holding '+' names one corpus."""
    if "+" not in spec or Path(spec).exists():
        return [spec]
    parts = spec.split("+")
    if any(not p for p in parts):
        raise CorpusError(f"corpus {spec!r}: an empty name in the mixture; join corpora as 'pydoc+stdlib-docs'")
    return parts


def load_corpus_text(spec: str) -> str:
    """Return the whole text of the corpus named by ``spec`` (see module docstring)."""
    if spec == "pydoc":
        return _pydoc_text()
    if spec == "stdlib-docs":
        return docstring_text(STDLIB_MODULES)
    path_part, _, field = spec.partition(".jsonl:")
    if "+" in spec and not Path(path_part).exists():
        raise CorpusError(f"corpus {spec!r} mixes corpora, which only [calibration] corpus does; name one corpus here "
                          "(distill mixes its training corpora with train_corpora)")
    if field:
        path, field = Path(path_part + ".jsonl"), field
    else:
        path, field = Path(spec), "text"
    if not path.exists():
        raise CorpusError(f"corpus {spec!r} not found; use 'pydoc', 'stdlib-docs', a .txt file, a folder of .txt or a .jsonl file")
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise CorpusError(f"corpus folder {path} holds no .txt files")
        text = "\n\n".join(f.read_text(encoding="utf-8") for f in files)
    elif path.suffix == ".jsonl":
        text = _jsonl_text(path, field)
    elif path.suffix == ".txt":
        text = path.read_text(encoding="utf-8")
    else:
        raise CorpusError(f"corpus {path} has unsupported type {path.suffix!r}; use .txt, .jsonl or a folder of .txt")
    if not text.strip():
        raise CorpusError(f"corpus {spec!r} is empty")
    return text
