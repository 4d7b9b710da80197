"""Test helpers that alter a compiled artifact on disk the way only a test should.

``rewrite_manifest`` stands for "a newer compile that wrote this manifest": it writes the edited
manifest and re-seals the weights file's metadata with its checksum, so tests can plant manifest
entries (an FP8 KV cache, an unknown format) and reach the checks behind the integrity check.
An edit without it is what the integrity check refuses.
"""
from __future__ import annotations

import json
from pathlib import Path

from compiler.io.artifact import MANIFEST, MANIFEST_SHA_KEY, WEIGHTS, manifest_sha256


def read_raw_manifest(artifact: Path) -> dict:
    return json.loads((Path(artifact) / MANIFEST).read_text())


def rewrite_weights(artifact: Path, tensors: dict, metadata: dict | None = None) -> None:
    """Replace the weights file with ``tensors`` (the old file's metadata unless ``metadata`` is given)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = Path(artifact) / WEIGHTS
    if metadata is None:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
    save_file(tensors, str(path), metadata=metadata)


def read_weights(artifact: Path) -> dict:
    from safetensors.torch import load_file

    return {name: t.clone() for name, t in load_file(str(Path(artifact) / WEIGHTS)).items()}


def rewrite_manifest(artifact: Path, manifest: dict) -> None:
    """Write ``manifest`` and re-seal the weights file's checksum of it."""
    from safetensors import safe_open

    artifact = Path(artifact)
    (artifact / MANIFEST).write_text(json.dumps(manifest, indent=1))
    with safe_open(str(artifact / WEIGHTS), framework="pt") as f:
        metadata = f.metadata()
    rewrite_weights(artifact, read_weights(artifact), {**metadata, MANIFEST_SHA_KEY: manifest_sha256(manifest)})
