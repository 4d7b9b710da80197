"""Text sources for calibration, evaluation and distillation.

A corpus spec is one string:
  - ``pydoc``: the built-in corpus, Python's ``pydoc_data.topics`` (keys sorted, texts joined by blank lines);
    it ships with every CPython, so nothing is downloaded;
  - a ``.txt`` file; a folder of ``.txt`` files (sorted by name, joined by blank lines);
  - a ``.jsonl`` file, optionally as ``file.jsonl:field`` (default field ``text``).
"""
from __future__ import annotations

import json
from pathlib import Path

BUILTIN_CORPORA = ("pydoc",)


class CorpusError(ValueError):
    """A corpus spec that names nothing readable."""


def _pydoc_text() -> str:
    from pydoc_data import topics

    return "\n\n".join(topics.topics[key] for key in sorted(topics.topics))


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


def load_corpus_text(spec: str) -> str:
    """Return the whole text of the corpus named by ``spec`` (see module docstring)."""
    if spec in BUILTIN_CORPORA:
        return _pydoc_text()
    path_part, _, field = spec.partition(".jsonl:")
    if field:
        path, field = Path(path_part + ".jsonl"), field
    else:
        path, field = Path(spec), "text"
    if not path.exists():
        raise CorpusError(f"corpus {spec!r} not found; use 'pydoc', a .txt file, a folder of .txt or a .jsonl file")
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
