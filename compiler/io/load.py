"""``load_checkpoint``: any model a user can name — a HF directory, a ``.gguf`` file, a compiled
artifact, or a built-in example model by name — as a ``LoadedModel``. ``locate_checkpoint`` is
the one place that decides which kind of checkpoint a path is; the loaders, the planning before a
load (``peek_config``) and the streamed compile all go by its answer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from compiler.errors import CheckpointError
from compiler.io.artifact import MANIFEST, load_artifact, read_manifest
from compiler.io.checkpoint import hf_config, load_gguf, load_hf_dir, resolve_model_path
from compiler.io.types import LoadedModel, parse_dtype
from compiler.model.config import ModelConfig


@dataclass(frozen=True)
class Checkpoint:
    """A model a user named, located: its path (a built-in name's file) and what kind of checkpoint it is."""

    path: Path
    kind: Literal["artifact", "hf", "gguf"]  # a qcompile artifact, a Hugging Face directory, a llama.cpp file


def locate_checkpoint(spec: str | Path | Checkpoint) -> Checkpoint:
    """Where ``spec`` (a path or a built-in model's name) is and what kind of checkpoint it is."""
    if isinstance(spec, Checkpoint):
        return spec
    path = resolve_model_path(spec)
    if path.is_dir() and (path / MANIFEST).exists():
        return Checkpoint(path, "artifact")
    if path.is_dir() and (path / "config.json").exists():
        return Checkpoint(path, "hf")
    if path.is_file() and path.suffix == ".gguf":
        return Checkpoint(path, "gguf")
    if path.is_dir():
        raise CheckpointError(f"{path}: neither a HF checkpoint (config.json) nor a qcompile artifact (manifest.json)")
    raise CheckpointError(f"{path}: unsupported file; give a HF directory, a .gguf file or an artifact directory")


def load_checkpoint(spec: str | Path | Checkpoint, dtype: str | torch.dtype = "float32", allow_pickle: bool = False,
                    with_tokenizer: bool = True) -> LoadedModel:
    """Load a HF directory, a ``.gguf`` file, a compiled artifact, or a built-in model by name."""
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    checkpoint = locate_checkpoint(spec)
    if checkpoint.kind == "artifact":
        return load_artifact(checkpoint.path)
    if checkpoint.kind == "hf":
        return load_hf_dir(checkpoint.path, dtype, allow_pickle, with_tokenizer)
    return load_gguf(checkpoint.path, dtype, with_tokenizer)


def peek_config(spec: str | Path | Checkpoint) -> ModelConfig:
    """The model config of a checkpoint, read without its weights (for planning before a load)."""
    checkpoint = locate_checkpoint(spec)
    if checkpoint.kind == "artifact":
        return read_manifest(checkpoint.path).config
    if checkpoint.kind == "hf":
        return hf_config(checkpoint.path)
    from compiler.io.gguf import read_gguf_config

    return read_gguf_config(checkpoint.path)


def loaded_dtype(checkpoint: Checkpoint, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``load_checkpoint(checkpoint, dtype)`` gives the weights: an artifact keeps the one
    it was compiled in, any other checkpoint loads in ``dtype``."""
    if checkpoint.kind == "artifact":
        return read_manifest(checkpoint.path).dtype
    return dtype
