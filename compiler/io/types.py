"""Types shared by the loaders, the artifact and everything that runs a model: where a model came
from (``SourceInfo``), a loaded model with its tokenizer (``LoadedModel``), dtypes by name,
content hashes and the tokenizer loader.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from compiler.errors import CheckpointError
from compiler.model.transformer import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SourceInfo:
    """Where a model came from; recorded in the artifact manifest."""

    path: str
    kind: str  # "hf" | "gguf" | "artifact"
    sha256: str
    size_bytes: int = 0

    def to_dict(self) -> dict:
        return {"path": self.path, "kind": self.kind, "sha256": self.sha256, "size_bytes": self.size_bytes}


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Any  # a transformers tokenizer, or None when the checkpoint ships none
    source: SourceInfo
    # Set when loaded from a compiled artifact: its manifest, a compiler.io.artifact.ArtifactRecord (named,
    # not imported: artifact.py imports this module).
    manifest: "ArtifactRecord | None" = None  # noqa: F821
    extras: dict = field(default_factory=dict)


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise CheckpointError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def sha256_files(paths: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def load_tokenizer(path: Path, gguf_file: str | None = None):
    from transformers import AutoTokenizer

    if gguf_file is None and not any((path / n).exists() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file)
    except Exception as e:
        raise CheckpointError(f"{path}: tokenizer files present but unreadable ({type(e).__name__}: {e})") from None
