"""Lowering to a model of NVIDIA's Triton vLLM backend (``qcompile lower ART --target triton --engine vllm``).

    REPO/
      <name>/
        config.pbtxt        backend: "vllm", decoupled, max_batch_size 0, one KIND_MODEL instance
                            (vLLM places itself on the GPU and batches requests itself)
        1/model.json        vLLM's engine arguments (the backend hands them to AsyncEngineArgs);
                            "model" is the checkpoint below, by its absolute path where the
                            server sees the repository (``repository_root``, default /models)
        1/checkpoint/       the compressed-tensors checkpoint ``lower --target vllm`` writes
                            (``backends/vllm/export.py``): config.json, safetensors, tokenizer

The layout is that of the backend's sample repository (triton-inference-server/vllm_backend,
samples/model_repository/vllm_model); the backend completes the inputs and outputs itself
(``text_input``, ``stream``, ``sampling_parameters`` … ``text_output``), so none are listed.
It runs in NVIDIA's ``tritonserver:<yy.mm>-vllm-python-py3`` image
(serving/containers/Dockerfile.triton-vllm-h100); it needs a CUDA GPU, and was not run here.
"""
from __future__ import annotations

import json
from pathlib import Path

from backends.vllm.export import VllmLowerOptions, check_artifact, export_vllm
from backends.vllm.runtime import engine_args
from compiler.io.artifact import read_manifest
from compiler.io.atomic import atomic_directory_write

CHECKPOINT_DIR = "checkpoint"  # inside the version folder 1/


def vllm_config_pbtxt(name: str) -> str:
    """The model configuration of a vLLM-backend model (protobuf text)."""
    return f"""# Written by 'qcompile lower --target triton --engine vllm': NVIDIA's vLLM backend runs 1/model.json.
name: "{name}"
backend: "vllm"
# vLLM batches requests itself, and streams them (the backend requires the decoupled policy).
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
# vLLM takes the GPU itself (KIND_MODEL), as in the backend's sample repository.
instance_group [ {{ count: 1 kind: KIND_MODEL }} ]
"""


def model_json(checkpoint: Path, served_path: str) -> dict:
    """The engine arguments for ``checkpoint``, which the server finds at ``served_path``: the same as
    ``qcompile serve --engine vllm`` passes (``backends.vllm.runtime.engine_args``), at the model's full context."""
    config = json.loads((checkpoint / "config.json").read_text())
    return engine_args(config, served_path, config["max_position_embeddings"])


def lower_triton_vllm(artifact: str | Path, out: str | Path, name: str, repository_root: str, force: bool = False) -> Path:
    """Write the vLLM-backend model ``out/<name>`` for ``artifact`` (atomically) and return its folder;
    ``repository_root`` is the absolute path the server loads the repository from."""
    artifact = Path(artifact)
    check_artifact(read_manifest(artifact), str(artifact))  # what vLLM cannot run is refused before any work
    served_path = f"{repository_root.rstrip('/')}/{name}/1/{CHECKPOINT_DIR}"

    def write(tmp: Path):
        version = tmp / "1"
        version.mkdir()
        checkpoint = export_vllm(artifact, version / CHECKPOINT_DIR, VllmLowerOptions()).path
        (version / "model.json").write_text(json.dumps(model_json(checkpoint, served_path), indent=2) + "\n")
        (tmp / "config.pbtxt").write_text(vllm_config_pbtxt(name))

    Path(out).mkdir(parents=True, exist_ok=True)
    atomic_directory_write(Path(out) / name, write, force)
    return Path(out) / name
