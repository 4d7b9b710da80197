"""``load_checkpoint``: any model a user can name — a HF directory, a ``.gguf`` file, a compiled
artifact, or a built-in example model by name — as a ``LoadedModel``."""
from __future__ import annotations

from pathlib import Path

import torch

from compiler.errors import CheckpointError
from compiler.io.artifact import MANIFEST, load_artifact, read_manifest
from compiler.io.checkpoint import hf_config, load_gguf, load_hf_dir, resolve_model_path
from compiler.io.types import LoadedModel, parse_dtype
from compiler.model.config import ModelConfig


def load_checkpoint(spec: str | Path, dtype: str | torch.dtype = "float32", allow_pickle: bool = False,
                    with_tokenizer: bool = True) -> LoadedModel:
    """Load a HF directory, a ``.gguf`` file, a compiled artifact, or a built-in model by name."""
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    path = resolve_model_path(spec)
    if path.is_dir() and (path / MANIFEST).exists():
        return load_artifact(path)
    if path.is_dir() and (path / "config.json").exists():
        return load_hf_dir(path, dtype, allow_pickle, with_tokenizer)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, dtype, with_tokenizer)
    if path.is_dir():
        raise CheckpointError(f"{path}: neither a HF checkpoint (config.json) nor a qcompile artifact (manifest.json)")
    raise CheckpointError(f"{path}: unsupported file; give a HF directory, a .gguf file or an artifact directory")


def peek_config(path: Path) -> ModelConfig:
    """The model config of a resolved model path, read without its weights (for planning before a load)."""
    if path.is_dir() and (path / MANIFEST).exists():
        return ModelConfig.from_dict(read_manifest(path)["model_config"])
    if path.is_dir() and (path / "config.json").exists():
        return hf_config(path)
    if path.is_file() and path.suffix == ".gguf":
        from compiler.io.gguf import read_gguf_config

        return read_gguf_config(path)
    return load_checkpoint(path).model.config  # the loader's own error names what is wrong
