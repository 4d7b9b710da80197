"""The compiled artifact: a directory that runs without its source checkpoint.

    OUT/
      manifest.json       schema version, source + SHA-256, model config, pipeline config,
                          each pass's report, every tensor's dtype/shape/SHA-256, every
                          converted module's format, extras (e.g. the serving plan)
      model.safetensors   float tensors and the packed buffers of quantized modules
      tokenizer files     as the tokenizer saves them

Written atomically (a hidden temp directory beside OUT, fsync, rename), so an interrupted
compile never leaves a directory that looks complete. Loading checks the schema version and
every tensor's checksum: a corrupt or truncated artifact is an error, never wrong outputs.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

import compiler.formats.fp8  # noqa: F401  (registers the fp8 weight format)
import compiler.formats.int4  # noqa: F401  (registers the int4 weight format)
from compiler.errors import ArtifactError
from compiler.formats.fp8_kv import install_kv_quant
from compiler.formats.qlinear import format_class, quantized_modules
from compiler.io.atomic import atomic_directory_write
from compiler.io.types import LoadedModel, SourceInfo, load_tokenizer, sha256_files
from compiler.model.config import ModelConfig
from compiler.model.transformer import Transformer, rope_inv_freq

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def _dedupe_shared(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses shared storage (tied embeddings): keep one name, record aliases."""
    seen: dict[tuple, str] = {}
    unique, aliases = {}, {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            unique[name] = t.detach().contiguous()
    return unique, aliases


def save_artifact(out: str | Path, model: Transformer, tokenizer: Any, source: SourceInfo,
                  pipeline: dict, reports: list[dict], extras: dict | None = None, force: bool = False) -> Path:
    """Write the artifact directory atomically and return its path."""
    from safetensors.torch import save_file

    state, aliases = _dedupe_shared(model.state_dict())
    modules = {name: m.format_meta() for name, m in quantized_modules(model).items()}
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": source.to_dict(),
        "model_config": model.config.to_dict(),
        "dtype": str(model.embed_tokens.weight.dtype).removeprefix("torch."),
        "pipeline": pipeline,
        "passes": reports,
        "modules": modules,
        "tensors": {n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": tensor_sha256(t)}
                    for n, t in state.items()},
        "aliases": aliases,
        "tokenizer": tokenizer is not None,
        **(extras or {}),
    }

    def write(tmp: Path):
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))

    out = Path(out)
    atomic_directory_write(out, write, force)
    return out


def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no {MANIFEST}; not a qcompile artifact (compile one with 'qcompile compile')") from None
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path / MANIFEST}: corrupt ({e}); recompile the artifact") from None
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ArtifactError(f"{path}: artifact schema version {version}, this qcompile reads {SCHEMA_VERSION}; recompile it")
    return manifest


def _read_tensors(path: Path, manifest: dict) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    expected = manifest["tensors"]
    state = {}
    try:
        with safe_open(str(path / WEIGHTS), framework="pt") as f:
            keys = set(f.keys())
            if keys != set(expected):
                missing = sorted(set(expected) - keys)[:3]
                raise ArtifactError(f"{path}: weights do not match the manifest (missing {missing}); the artifact is corrupt, recompile it")
            for name in expected:
                t = f.get_tensor(name)
                if tensor_sha256(t) != expected[name]["sha256"]:
                    raise ArtifactError(f"{path}: tensor {name} fails its checksum; the artifact is corrupt, recompile it")
                state[name] = t
    except (SafetensorError, OSError) as e:
        raise ArtifactError(f"{path / WEIGHTS}: unreadable ({e}); the artifact is corrupt or truncated, recompile it") from None
    return state


def build_from_manifest(manifest: dict, state: dict[str, torch.Tensor]) -> Transformer:
    config = ModelConfig.from_dict(manifest["model_config"])
    with torch.device("meta"):
        model = Transformer(config)
    dtype = getattr(torch, manifest["dtype"])
    for name, meta in manifest["modules"].items():
        linear = model.get_submodule(name)
        with torch.device("meta"):
            q = format_class(meta["format"]).empty(meta, linear.in_features, linear.out_features, linear.bias is not None, dtype)
        model.set_submodule(name, q)
    for alias, target in manifest.get("aliases", {}).items():
        state[alias] = state[target]
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ArtifactError(f"artifact tensors do not fit its model config ({str(e).splitlines()[0]}); recompile it") from None
    if config.tie_embeddings and "lm_head.weight" in manifest.get("aliases", {}):
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(config)
    if manifest.get("kv_cache"):
        install_kv_quant(model, manifest["kv_cache"])
    return model.eval()


def load_artifact(path: str | Path) -> LoadedModel:
    """The runnable model (``forward(input_ids[B, T]) -> logits[B, T, V]``) and tokenizer of an artifact."""
    path = Path(path)
    manifest = read_manifest(path)
    model = build_from_manifest(manifest, _read_tensors(path, manifest))
    tokenizer = load_tokenizer(path) if manifest.get("tokenizer") else None
    source = SourceInfo(str(path.resolve()), "artifact", sha256_files([path / MANIFEST]), (path / WEIGHTS).stat().st_size)
    return LoadedModel(model, tokenizer, source, manifest)
