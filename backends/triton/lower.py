"""Lowering an artifact to a Triton Inference Server model repository (with ``engine = "vllm"``, a
model of NVIDIA's vLLM backend instead: ``vllm_repo.py``).

    REPO/
      <name>/
        config.pbtxt        Python backend, decoupled, generate-extension inputs/outputs
        1/model.py          an entry importing ``serving.triton_backend.TritonPythonModel``,
                            which loads the engine once
        1/artifact/         the artifact (hard links where possible), so the repository is
                            self-contained and can be baked into a container image

The generate-extension names follow Triton's vLLM backend, so stock clients (the
``/generate`` and ``/generate_stream`` endpoints, gRPC streams) work unchanged.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from compiler.deploy.targets import check_formats
from compiler.errors import ConfigError
from compiler.io.artifact import ArtifactRecord, check_lowered_entries, read_manifest
from compiler.io.atomic import atomic_directory_write
from compiler.options import option

# The repository's model.py: the model itself lives in the serving layer (serving/triton_backend.py),
# which this layer may not import; the server's Python imports it at load time. The Python-backend
# stub ignores PYTHONPATH, so the server launcher passes qcompile's path in QCOMPILE_PYTHONPATH.
MODEL_ENTRY = '''"""Written by 'qcompile lower --target triton': the qcompile engine behind Triton's Python backend."""
import os
import sys

for _p in reversed(os.environ.get("QCOMPILE_PYTHONPATH", "").split(":")):
    if _p and _p not in sys.path:
        sys.path.insert(0, _p)

from serving.triton_backend import TritonPythonModel  # noqa: E402,F401
'''
# Triton instance kind per device: it has no NPU kind, so on Ascend the model places itself (KIND_MODEL).
DEVICES = {"cpu": "KIND_CPU", "cuda": "KIND_GPU", "npu": "KIND_MODEL"}
# What runs the model inside Triton: qcompile's engine in the Python backend (this file), or NVIDIA's
# vLLM backend on the compressed-tensors checkpoint of the vllm target (vllm_repo.py).
ENGINES = ("qcompile", "vllm")
DEFAULT_REPOSITORY_ROOT = "/models"  # where Dockerfile.triton-vllm-h100 puts the repository

# (name, Triton type, dims, optional) in the order clients see them.
INPUTS = [
    ("text_input", "TYPE_STRING", [1], True),
    ("input_ids", "TYPE_INT32", [-1], True),  # token ids instead of text (benchmarks use exact lengths)
    ("max_tokens", "TYPE_INT32", [1], True),
    ("temperature", "TYPE_FP32", [1], True),
    ("top_k", "TYPE_INT32", [1], True),
    ("top_p", "TYPE_FP32", [1], True),
    ("seed", "TYPE_INT64", [1], True),
    ("stop", "TYPE_STRING", [-1], True),
    ("ignore_eos", "TYPE_BOOL", [1], True),
    ("stream", "TYPE_BOOL", [1], True),
]
OUTPUTS = [
    ("text_output", "TYPE_STRING", [-1]),
    ("token_ids", "TYPE_INT32", [-1]),
    ("finish_reason", "TYPE_STRING", [-1]),
]
# The manifest entries passes declared (ArtifactRecord.extras) the served engine reads and runs as
# declared: the KV cache (its paged cache stores FP8 E4M3 or int8 codes with these scales) and the
# serving plan.
LOWERED_ENTRIES = frozenset({"kv_cache", "serving"})
# Kernels the engine runs per weight format on CUDA hosts (recorded, and checked at load).
CUDA_KERNELS = {"int4": "w4a16_int4_gemm", "fp8": "fp8_gemm"}


@dataclass(frozen=True)
class LowerOptions:
    device: str = option("cpu", "Compute device the served model runs on: cpu, cuda (H100 kernels) or npu (Ascend, "
                                "torch_npu); it sets the instance kind (KIND_CPU, KIND_GPU, KIND_MODEL).")
    name: str | None = option(None, "Model name in the repository; default: the artifact folder's name.")
    instances: int = option(1, "Model instances, one engine each (the engine itself batches all requests).")
    max_tokens_limit: int | None = option(None, "Most tokens a request may ask for; default: the model's context length.")
    engine: str = option("qcompile", "What serves the model: qcompile (its engine in Triton's Python backend) or vllm "
                                     "(NVIDIA's vLLM backend on a compressed-tensors checkpoint; with --device cuda).")
    repository_root: str | None = option(None, "engine vllm: the absolute path the server loads the repository from "
                                               f"(model.json names the checkpoint under it); default {DEFAULT_REPOSITORY_ROOT}.")

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"unknown device {self.device!r}; use one of {', '.join(DEVICES)}")
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; use one of {', '.join(ENGINES)}")
        if self.engine == "vllm":
            if self.device != "cuda":
                raise ValueError(f"engine 'vllm' (NVIDIA's Triton vLLM backend) runs on CUDA GPUs, not {self.device!r}; "
                                 "add --device cuda")
            if self.instances != 1 or self.max_tokens_limit is not None:
                raise ValueError("engine 'vllm' takes neither instances nor max_tokens_limit (vLLM batches requests "
                                 "and bounds their lengths itself); drop them")
            if self.repository_root is not None and not self.repository_root.startswith("/"):
                raise ValueError(f"repository_root {self.repository_root!r} must be an absolute path (vLLM resolves "
                                 "a relative one against the server's working directory)")
        elif self.repository_root is not None:
            raise ValueError("repository_root is for engine 'vllm' (the qcompile engine finds its artifact itself); drop it")
        if self.name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise ValueError(f"model name {self.name!r}: use letters, digits, '_', '-', '.'")
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances}")


def precision_and_kernels(record: ArtifactRecord, device: str) -> tuple[str, list[str]]:
    """What the repository expects to run: the artifact's precision and, per device, the kernels."""
    formats = sorted({m["format"] for m in record.modules.values()})
    precision = "+".join([record.dtype_name, *formats])
    if device != "cuda":
        return precision, ["torch"]  # the engine's torch reference paths (torch_npu kernels on Ascend)
    kernels = [CUDA_KERNELS.get(f.split("_")[0], f"{f}_gemm") for f in formats]
    return precision, sorted(set(kernels)) + ["paged_attention_decode"]


def _tensor_block(kind: str, name: str, dtype: str, dims: list[int], optional: bool | None) -> str:
    lines = [f'    name: "{name}"', f"    data_type: {dtype}", f"    dims: [ {', '.join(map(str, dims))} ]"]
    if optional:
        lines.append("    optional: true")
    return "  {\n" + "\n".join(lines) + "\n  }"


def config_pbtxt(name: str, opts: LowerOptions, record: ArtifactRecord, artifact_param: str) -> str:
    """The model configuration (protobuf text) for ``name``."""
    precision, kernels = precision_and_kernels(record, opts.device)
    max_ctx = record.config.max_seq_len
    params = {
        "artifact": artifact_param,
        "device": opts.device,
        "precision": precision,
        "kernels": ",".join(kernels),
        "max_tokens_limit": str(opts.max_tokens_limit or max_ctx),
    }
    inputs = ",\n".join(_tensor_block("input", n, t, d, o) for n, t, d, o in INPUTS)
    outputs = ",\n".join(_tensor_block("output", n, t, d, None) for n, t, d in OUTPUTS)
    kind = DEVICES[opts.device]
    param_lines = "\n".join(f'parameters: {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items())
    return f"""# Written by 'qcompile lower --target triton'; the engine batches requests itself (max_batch_size 0).
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [
{inputs}
]
output [
{outputs}
]
instance_group [ {{ count: {opts.instances} kind: {kind} }} ]
{param_lines}
"""


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def lower_triton(artifact: str | Path, out: str | Path, opts: LowerOptions = LowerOptions(), force: bool = False) -> Path:
    """Write the model ``out/<name>`` for ``artifact`` (atomically) and return its folder.

    ``out`` is a model repository: it may already hold other models, which are left alone, so
    several artifacts (float, INT4, FP8) can be served side by side by one server.
    """
    artifact = Path(artifact)
    name = opts.name or re.sub(r"[^A-Za-z0-9_.-]", "_", artifact.resolve().name)
    if opts.engine == "vllm":
        from backends.triton.vllm_repo import lower_triton_vllm

        return lower_triton_vllm(artifact, out, name, opts.repository_root or DEFAULT_REPOSITORY_ROOT, force)
    record = read_manifest(artifact)
    check_formats("triton", record.modules, str(artifact))
    check_lowered_entries(record, "triton", LOWERED_ENTRIES, str(artifact))
    if opts.device != "cpu" and (record.serving or {}).get("int4_compute") == "w4a8":
        raise ConfigError(f"{artifact}: its serving plan runs INT4 on int8 activations (int4_compute \"w4a8\"), a CPU "
                          f"kernel the engine has no {opts.device} form of; lower it with --device cpu, or compile with "
                          "int4_compute = \"w4a16\"")

    def write(tmp: Path):
        version = tmp / "1"
        version.mkdir()
        shutil.copytree(artifact, version / "artifact", copy_function=_link_or_copy)
        (version / "model.py").write_text(MODEL_ENTRY)
        (tmp / "config.pbtxt").write_text(config_pbtxt(name, opts, record, "artifact"))

    Path(out).mkdir(parents=True, exist_ok=True)
    atomic_directory_write(Path(out) / name, write, force)
    return Path(out) / name
