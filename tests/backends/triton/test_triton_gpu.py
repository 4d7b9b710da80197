"""Triton's KIND_GPU lowering end to end (``pytest -m gpu``; skipped with the reason elsewhere): a
repository lowered with ``device = "cuda"`` is served by the real Triton Inference Server, whose
model instance runs the engine on the GPU; its greedy tokens are the in-process engine's on CUDA."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.integration]
PROMPTS = ["def f(x):", "import os", "class A:"]
MAX_TOKENS = 8


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


async def _greedy(adapter, prompt: str) -> list[int]:
    from serving.types import SamplingParams

    try:
        events = [e async for e in adapter.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    finally:
        await adapter.close()
    return [t for e in events for t in e.token_ids]


def test_kind_gpu_repository_serves_the_engine_on_cuda(tiny_checkpoint_with_tokenizer, tmp_path):
    import backends  # noqa: F401  (registers the triton target)
    from backends.triton.runtime import free_port, prepare_runtime
    from compiler.deploy.lowering import lower
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model
    from serving.adapters.triton_http import TritonHttpAdapter
    from serving.engine import Engine

    src, _ = tiny_checkpoint_with_tokenizer("llama")
    artifact = compile_model(src, PipelineConfig(), tmp_path / "art").path
    model_dir = lower(artifact, "triton", tmp_path / "repo", {"device": "cuda", "name": "tiny"}).path
    assert "kind: KIND_GPU" in (model_dir / "config.pbtxt").read_text()
    engine = Engine.from_artifact(artifact, "cuda")
    expected = [engine.generate(prompt=p, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids for p in PROMPTS]

    prepare_runtime()
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    project = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": f"{project}:{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-c", "from qcompile.cli import main; main()", "serve", str(tmp_path / "repo"),
           "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]), "--metrics-port", str(ports["metrics"]),
           "--log-file", str(tmp_path / "serve.log")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not _ready(ports["http"]):
            assert proc.poll() is None, f"qcompile serve exited early: {(tmp_path / 'serve.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "server not ready in 240 s"
            time.sleep(0.5)
        got = [asyncio.run(_greedy(TritonHttpAdapter(f"127.0.0.1:{ports['http']}", "tiny"), p)) for p in PROMPTS]
        assert got == expected
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
