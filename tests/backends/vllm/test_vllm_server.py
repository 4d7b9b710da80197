"""Against the real vLLM (the CPU wheel in .venv-vllm, installed by scripts/setup_vllm.sh).

Tiny Llama and Qwen2 checkpoints (random weights, the byte-level tokenizer) are compiled as INT4,
INT8 W8A8 (dynamic symmetric and asymmetric, static asymmetric) and FP8, lowered with ``--target vllm`` and served by vLLM, one server per model (each start
takes one to three minutes on 2 cores; ``--enforce-eager`` skips torch.compile's warm-up). vLLM's
greedy tokens are compared with qcompile's engine on the same artifact, its prompt
log-probabilities with the artifact's own, and compressed-tensors' decompressor with the
artifact's dequantized weights. Not skipped without vLLM: a missing install is a failure.

Where vLLM's build on this host has no W4A16 kernel (its AVX2 build: an AVX2-only CPU, or
QCOMPILE_VLLM_PYTHON=tests/doubles/vllm_avx2_host/python), each INT4 export is checked to reach
vLLM's CPU W4A16 kernel and fail there only (started past qcompile's up-front refusal, which
test_vllm_host.py tests); the decompressor still checks its contents. INT8 W8A8 runs on every
build (oneDNN's int8 GEMM). The ``qcompile serve`` and ``bench`` chain serves the INT8 export, and
the FP8 export with an FP8 KV cache where vLLM's build takes one (AVX-512 or AMX), without it elsewhere.

vLLM's CPU kernels round in two places as qcompile does not (``vllm_cpu_reference``): with an FP8
KV cache its tokens are therefore compared with the artifact's own greedy decode under those
roundings, not with qcompile's engine (they part within a few tokens; docs/DEPLOY.md says why).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_helpers import (FP8, FP8_KV, INT4, INT8, INT8_ASYMMETRIC, INT8_ROTATED, INT8_STATIC, ROOT, VLLM_PYTHON, assert_decompresses_to_the_artifact, assert_vllm_refuses_int4,
                          compare_with_engine, compile_for, save_checkpoint, start_server, vllm_here)

from compiler.deploy.lowering import lower

pytestmark = pytest.mark.integration

# llama-int4-f32: a float32 artifact with INT4 layers, which the export writes in float16
MODELS = {"llama-int4": ("llama", INT4), "qwen2-int4": ("qwen2", INT4), "llama-fp8": ("llama", FP8),
          "qwen2-fp8": ("qwen2", FP8), "llama-fp8-kv": ("llama", FP8_KV),
          "llama-int4-f32": ("llama", {**INT4, "model": {"dtype": "float32"}}), "llama-int8": ("llama", INT8),
          "qwen2-int8-asymmetric": ("qwen2", INT8_ASYMMETRIC), "llama-int8-static": ("llama", INT8_STATIC),
          "llama-int8-rotated": ("llama-tied", INT8_ROTATED)}
KERNELS = {"int4": "CPUWNA16LinearKernel", "int8": "CompressedTensorsW8A8Int8", "fp8": "CompressedTensorsW8A8Fp8"}


def checkpoint_dtype(checkpoint: Path) -> str:
    return json.loads((checkpoint / "config.json").read_text())["dtype"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Every model of MODELS as (artifact, vLLM checkpoint)."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"vLLM is not installed at {VLLM_PYTHON}; run scripts/setup_vllm.sh (scripts/setup.sh does)")
    root = tmp_path_factory.mktemp("vllm")
    checkpoints = {arch: save_checkpoint(root, arch) for arch in ("llama", "qwen2")}
    checkpoints["llama-tied"] = save_checkpoint(root / "tied", "llama", tie_word_embeddings=True)
    out = {}
    for name, (arch, pipeline) in MODELS.items():
        artifact = compile_for(checkpoints[arch], pipeline, root / f"artifact-{name}")
        out[name] = artifact, lower(artifact, "vllm", root / f"vllm-{name}").path
    return out


@pytest.mark.parametrize("name", ["llama-int4", "qwen2-int4", "llama-fp8", "qwen2-fp8", "llama-int4-f32", "llama-int8",
                                  "qwen2-int8-asymmetric", "llama-int8-static", "llama-int8-rotated"])
def test_vllm_runs_the_export_as_the_engine_does(exported, name, tmp_path):
    artifact, checkpoint = exported[name]
    if "int4" in name and not vllm_here().w4a16:
        assert_vllm_refuses_int4(checkpoint, tmp_path / "vllm.log")
        return
    server = start_server(checkpoint, tmp_path / "vllm.log")
    try:
        result = compare_with_engine(artifact, server.url, server.model, checkpoint_dtype(checkpoint))
        log = (tmp_path / "vllm.log").read_text(errors="replace")
        kernel = KERNELS[name.split("-")[1]]
        assert kernel in log, f"vLLM did not run its {kernel}"
        print(name, result)
    finally:
        assert server.stop() == 0


def test_compressed_tensors_decompressor_gives_the_artifacts_weights(exported, tmp_path):
    for name, (artifact, checkpoint) in exported.items():
        assert_decompresses_to_the_artifact(artifact, checkpoint, tmp_path / f"{name}.safetensors")


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_qcompile_serve_engine_vllm_and_bench_openai(exported, tmp_path, kind):
    """``qcompile serve CHECKPOINT --engine vllm``: ready line, greedy parity, a bench run, a clean SIGTERM stop;
    the INT8 export (every vLLM build) and the FP8 one (with an FP8 KV cache where the build takes it: AVX-512 or AMX)."""
    from backends.triton.runtime import free_port

    fp8 = "llama-fp8-kv" if vllm_here().fp8_kv_cache else "llama-fp8"
    artifact, checkpoint = exported["llama-int8" if kind == "int8" else fp8]
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    serve = subprocess.Popen([sys.executable, "-m", "qcompile", "serve", str(checkpoint), "--engine", "vllm",
                              "--http-port", str(port), "--log-file", str(tmp_path / "vllm.log")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines = []
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not any("Ctrl-C to stop" in ln for ln in lines):  # the ready message's end
            line = serve.stdout.readline()
            if not line:
                break
            lines.append(line)
        assert any(ln.startswith("ready") for ln in lines), "".join(lines)
        model = str(checkpoint.resolve())
        assert f"qcompile bench openai://127.0.0.1:{port}" in "".join(lines)
        compare_with_engine(artifact, f"127.0.0.1:{port}", model)
        bench = subprocess.run([sys.executable, "-m", "qcompile", "bench", f"openai://127.0.0.1:{port}", "--concurrency", "2",
                                "--num-requests", "4", "--warmup", "0", "--prompt-len", "16", "--output-len", "8",
                                "--output-json", str(tmp_path / "bench.json")], capture_output=True, text=True, env=env, cwd=ROOT,
                               timeout=600)
        assert bench.returncode == 0, bench.stdout + bench.stderr
        counts = json.loads((tmp_path / "bench.json").read_text())["runs"][0]["metrics"]["counts"]
        assert counts["successful"] == 4 and counts["output_tokens"] == 32 and counts["output_length_mismatch"] == 0
    finally:
        serve.send_signal(signal.SIGTERM)
        rest, _ = serve.communicate(timeout=120)
    assert serve.returncode == 0, rest
    assert re.search(r"vllm serve stopped \(exit code 0\)", rest), rest
