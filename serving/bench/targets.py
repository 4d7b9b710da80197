"""Resolve a ``qcompile bench`` TARGET to the serving adapter that drives it.

  ARTIFACT_DIR                       in-process engine (``serving.adapters.engine.EngineAdapter``)
  triton-grpc://HOST:PORT/MODEL      Triton Inference Server over gRPC (streaming)
  triton-http://HOST:PORT/MODEL      Triton Inference Server over HTTP (generate_stream, or generate with --no-stream)
  openai://HOST:PORT[/MODEL]         any OpenAI-compatible server, streamed /v1/completions (vLLM, SGLang, …);
                                     MODEL defaults to the one /v1/models lists
  ONNX_DIR (holds *.onnx)            ONNX Runtime (``qcompile lower --target onnx``)
  ASCEND_BUNDLE (om/, build_om.sh)   Ascend NPU bundle (``qcompile lower --target ascend``)

Lives in the CLI layer because adapters come from several packages; each is imported only
when its target is asked for, and one that is not available in this build is a clear error.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from serving.bench.errors import BenchError

SCHEMES = ("triton-grpc", "triton-http", "openai")


@dataclass(frozen=True)
class Target:
    """A parsed TARGET: its kind, and either a directory or a server address + model name."""

    kind: str  # "engine", "triton-grpc", "triton-http", "openai", "onnx", "ascend"
    spec: str
    path: Path | None = None
    url: str | None = None  # HOST:PORT
    model: str | None = None


def parse_target(spec: str) -> Target:
    """Classify TARGET by its scheme or by what its directory holds."""
    scheme = spec.split("://", 1)[0] if "://" in spec else None
    if scheme is not None:
        parsed = urlparse(spec)
        model = parsed.path.strip("/")
        if scheme not in SCHEMES or not parsed.hostname or not parsed.port or not (model or scheme == "openai"):
            raise BenchError(f"target {spec!r} is not valid; use triton-grpc://HOST:PORT/MODEL, "
                             "triton-http://HOST:PORT/MODEL or openai://HOST:PORT[/MODEL]")
        url = f"{parsed.hostname}:{parsed.port}"
        if scheme == "openai" and not model:
            model = _served_model(url)
        return Target(scheme, spec, url=url, model=model)
    path = Path(spec)
    if not path.is_dir():
        raise BenchError(f"target {spec!r} is neither a directory nor a triton-grpc://, triton-http:// or openai:// address")
    if (path / "om").is_dir() or (path / "build_om.sh").is_file():  # qcompile lower --target ascend
        return Target("ascend", spec, path=path)
    if any(path.glob("*.onnx")):
        return Target("onnx", spec, path=path)
    if (path / "manifest.json").is_file():
        return Target("engine", spec, path=path)
    raise BenchError(f"{spec} holds no manifest.json, *.onnx or om/; give an artifact, an ONNX Runtime bundle or an Ascend bundle")


def _served_model(url: str) -> str:
    """The one model an OpenAI-compatible server at ``url`` serves (several: the target must name one)."""
    from serving.adapters.openai import OpenAIRequestError, served_models

    try:
        models = served_models(url)
    except OpenAIRequestError as e:
        raise BenchError(str(e)) from None
    if len(models) != 1:
        listed = ", ".join(models) or "none"
        raise BenchError(f"openai://{url} serves {len(models)} models ({listed}); name one: openai://{url}/MODEL")
    return models[0]


def check_stream(target: Target, stream: bool) -> None:
    if not stream and target.kind != "triton-http":
        raise BenchError("--no-stream applies to triton-http:// targets only (the others always stream)")


def _import(module: str, attr: str, what: str):
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        raise BenchError(f"the {what} adapter ({module}.{attr}) is not available in this build; "
                         "install or merge the serving adapter for it, or bench another target") from None


def open_adapter(target: Target, stream: bool = True, engine_plan: dict | None = None):
    """A ``ServingAdapter`` for ``target`` (the caller closes it); ``stream=False``: HTTP's one-response ``/generate``;
    ``engine_plan``: serving-plan settings over an artifact's own (e.g. ``{"int4_compute": "w4a8"}``)."""
    if engine_plan and target.kind != "engine":
        options = ", ".join(f"--{k.replace('_', '-')}" for k in engine_plan)
        raise BenchError(f"{options}: a setting of the in-process engine, for artifact targets only; "
                         f"this {target.kind} target computes as it was built")
    if target.kind == "engine":
        return _import("serving.adapters.engine", "EngineAdapter", "in-process engine").from_artifact(target.path,
                                                                                                      **(engine_plan or {}))
    if target.kind == "triton-grpc":
        return _import("serving.adapters.triton_grpc", "TritonGrpcAdapter", "Triton gRPC")(target.url, target.model)
    if target.kind == "triton-http":
        return _import("serving.adapters.triton_http", "TritonHttpAdapter", "Triton HTTP")(target.url, target.model, stream)
    if target.kind == "openai":
        return _import("serving.adapters.openai", "OpenAIAdapter", "OpenAI-compatible")(target.url, target.model)
    if target.kind == "onnx":
        return _import("serving.adapters.onnx", "OnnxRuntimeAdapter", "ONNX Runtime").from_dir(target.path)
    return _import("serving.adapters.ascend", "AscendAdapter", "Ascend").from_bundle(target.path)


def target_tokenizer(target: Target, tokenizer_path: Path | None):
    """The tokenizer prompts are built with: ``--tokenizer`` if given, else the target directory's own."""
    from compiler.io.types import load_tokenizer

    source = tokenizer_path or target.path
    if source is None and target.kind == "openai" and target.model and Path(target.model).is_dir():
        source = Path(target.model)  # vLLM names a model served from a local directory by its path
    if source is None:
        return None
    if not Path(source).is_dir():
        raise BenchError(f"--tokenizer {source} is not a directory; give an artifact or HF checkpoint directory")
    return load_tokenizer(Path(source))


def artifact_dir(target: Target) -> Path | None:
    """The artifact whose manifest hash the result records (the target's own directory)."""
    return target.path if target.path is not None and (target.path / "manifest.json").is_file() else None
