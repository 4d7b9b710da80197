"""Against the real vLLM (the CPU wheel in .venv-vllm, installed by scripts/setup_vllm.sh).

Tiny Llama and Qwen2 checkpoints (random weights, the byte-level tokenizer) are compiled as INT4
and FP8, lowered with ``--target vllm`` and served by vLLM, one server per model (each start
takes one to three minutes on 2 cores; ``--enforce-eager`` skips torch.compile's warm-up). vLLM's
greedy tokens are compared with qcompile's engine on the same artifact, its prompt
log-probabilities with the artifact's own, and compressed-tensors' decompressor with the
artifact's dequantized weights. Not skipped without vLLM: a missing install is a failure.
"""
from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from vllm_helpers import FP8, INT4, ROOT, VLLM_PYTHON, compile_for, save_checkpoint

from backends.vllm.evaluate import window_logprobs
from backends.vllm.runtime import VllmOptions, VllmServer
from compiler.deploy.lowering import lower
from compiler.formats.qlinear import quantized_modules
from compiler.io.artifact import load_artifact
from serving.adapters.engine import EngineAdapter
from serving.adapters.openai import OpenAIAdapter
from serving.types import SamplingParams

pytestmark = pytest.mark.integration

MODELS = {"llama-int4": ("llama", INT4), "qwen2-int4": ("qwen2", INT4), "qwen2-fp8": ("qwen2", FP8),
          "llama-fp8": ("llama", FP8)}
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(100, 124))]
TOKENS = 16
# Two implementations of one model agree on a greedy token unless the model's own two best
# logits are this close (a numerical tie; the continuations may then differ).
TIE = {"float16": 0.1, "bfloat16": 0.25, "float32": 0.05}
# Prompt log-probabilities are compared with the artifact's own math in float32 (its dequantized
# weights are exact there). In float16 or bfloat16 both engines round; vLLM's error may be a few
# times qcompile's own (its kernels round at other places), never more than LOGPROB_ROUNDING times
# it, nor above the floor in float32, where a wrong zero point or scale moves log p by whole units.
LOGPROB_ROUNDING = 4.0
LOGPROB_FLOOR = {"float16": 0.02, "bfloat16": 0.1, "float32": 0.01}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Every model of MODELS as (artifact, vLLM checkpoint)."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"vLLM is not installed at {VLLM_PYTHON}; run scripts/setup_vllm.sh (scripts/setup.sh does)")
    root = tmp_path_factory.mktemp("vllm")
    checkpoints = {arch: save_checkpoint(root, arch) for arch in ("llama", "qwen2")}
    out = {}
    for name, (arch, pipeline) in MODELS.items():
        artifact = compile_for(checkpoints[arch], pipeline, root / f"artifact-{name}")
        out[name] = artifact, lower(artifact, "vllm", root / f"vllm-{name}")
    return out


def _start(checkpoint: Path, log: Path) -> VllmServer:
    from backends.triton.runtime import free_port

    opts = VllmOptions(checkpoint, port=free_port(), served_name="tiny", extra_args=["--enforce-eager"])
    return VllmServer(opts, log_path=log).start()


async def _greedy(adapter, prompt: list[int]) -> list[int]:
    ids = []
    async for event in adapter.generate(prompt, SamplingParams(max_tokens=TOKENS, ignore_eos=True)):
        ids += event.token_ids
    return ids


def _tokens(adapter) -> list[list[int]]:
    async def run():
        try:
            return [await _greedy(adapter, p) for p in PROMPTS]
        finally:
            await adapter.close()
    return asyncio.run(run())


def _first_disagreement(model, prompt: list[int], ours: list[int], theirs: list[int], tie: float) -> str | None:
    """None when ``theirs`` equals ``ours``, or first differs where our two best logits are within ``tie``."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ours[:i]]))[0, -1].float()
        top2 = logits.topk(2).values
        gap = float(top2[0] - top2[1])
        if float(logits[a] - logits[b]) > tie:
            return f"token {i}: engine {a}, vLLM {b}; logit gap {float(logits[a] - logits[b]):.3f} (top-2 gap {gap:.3f})"
        return None  # a numerical tie: what follows legitimately differs
    return None if len(ours) == len(theirs) == TOKENS else f"lengths {len(ours)} and {len(theirs)}"


def _window_logprobs(model, window: list[int]) -> torch.Tensor:
    """log p(window[t] | window[:t]) for t = 1..T-1 under ``model``."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([window]))[0].float(), -1)
    return logp[torch.arange(len(window) - 1), torch.tensor(window[1:])]


def _compare_with_engine(artifact: Path, url: str, model_name: str) -> dict:
    loaded = load_artifact(artifact)
    dtype = loaded.manifest["dtype"]
    engine = _tokens(EngineAdapter.from_artifact(artifact))
    served = _tokens(OpenAIAdapter(url, model_name))
    problems = [why for p, a, b in zip(PROMPTS, engine, served) if (why := _first_disagreement(loaded.model, p, a, b, TIE[dtype]))]
    assert not problems, problems
    window = list(range(3, 67))
    exact = _window_logprobs(copy.deepcopy(loaded.model).float(), window)  # the artifact's math, in float32
    engine_err = float((_window_logprobs(loaded.model, window) - exact).abs().max())
    got = torch.tensor(window_logprobs(url, model_name, window))
    err = float((got - exact).abs().max())
    bound = max(LOGPROB_ROUNDING * engine_err, LOGPROB_FLOOR[dtype])
    assert err < bound, f"vLLM's prompt log-probabilities differ from float32 by up to {err:.4f} (engine: {engine_err:.4f})"
    return {"max_logprob_error": err, "engine_max_logprob_error": engine_err}


# Not yet run to completion here (issue 22): FP8 on vLLM 0.32's CPU kernels, and `qcompile serve
# --engine vllm` with a bench run; both run by hand before they gate CI.
UNRUN = pytest.mark.skip(reason="not yet run to completion on the real vLLM here; see issue 22's note")


@pytest.mark.parametrize("name", ["llama-int4", "qwen2-int4", pytest.param("qwen2-fp8", marks=UNRUN)])
def test_vllm_runs_the_export_as_the_engine_does(exported, name, tmp_path):
    artifact, checkpoint = exported[name]
    server = _start(checkpoint, tmp_path / "vllm.log")
    try:
        result = _compare_with_engine(artifact, server.url, server.model)
        log = (tmp_path / "vllm.log").read_text(errors="replace")
        kernel = "CPUWNA16LinearKernel" if "int4" in name else "CompressedTensorsW8A8Fp8"
        assert kernel in log, f"vLLM did not run its {kernel}"
        print(name, result)
    finally:
        assert server.stop() == 0


def test_compressed_tensors_decompressor_gives_the_artifacts_weights(exported, tmp_path):
    for name, (artifact, checkpoint) in exported.items():
        out = tmp_path / f"{name}.safetensors"
        subprocess.run([str(VLLM_PYTHON), str(Path(__file__).with_name("ct_decompress.py")), str(checkpoint), str(out)],
                       check=True, capture_output=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                       timeout=600)
        from safetensors.torch import load_file

        decompressed = load_file(str(out))
        modules = quantized_modules(load_artifact(artifact).model)
        assert set(decompressed) == {f"model.{n}" for n in modules}
        for n, module in modules.items():
            assert torch.equal(decompressed[f"model.{n}"], module.dequantized_weight()), (name, n)  # bit for bit


@UNRUN
def test_qcompile_serve_engine_vllm_and_bench_openai(exported, tmp_path):
    """``qcompile serve CHECKPOINT --engine vllm``: ready line, greedy parity, a bench run, a clean SIGTERM stop."""
    from backends.triton.runtime import free_port

    artifact, checkpoint = exported["llama-fp8"]
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    serve = subprocess.Popen([sys.executable, "-m", "qcompile", "serve", str(checkpoint), "--engine", "vllm",
                              "--http-port", str(port), "--log-file", str(tmp_path / "vllm.log")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines = []
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not any("ready" in ln for ln in lines):
            line = serve.stdout.readline()
            if not line:
                break
            lines.append(line)
        assert any("ready" in ln for ln in lines), "".join(lines)
        model = str(checkpoint.resolve())
        assert f"qcompile bench openai://127.0.0.1:{port}" in "".join(lines)
        _compare_with_engine(artifact, f"127.0.0.1:{port}", model)
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
