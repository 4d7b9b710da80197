"""Against the real vLLM (the CPU wheel in .venv-vllm, installed by scripts/setup_vllm.sh).

Tiny Llama and Qwen2 checkpoints (random weights, the byte-level tokenizer) are compiled as INT4
and FP8, lowered with ``--target vllm`` and served by vLLM, one server per model (each start
takes one to three minutes on 2 cores; ``--enforce-eager`` skips torch.compile's warm-up). vLLM's
greedy tokens are compared with qcompile's engine on the same artifact, its prompt
log-probabilities with the artifact's own, and compressed-tensors' decompressor with the
artifact's dequantized weights. Not skipped without vLLM: a missing install is a failure.

vLLM's CPU kernels round in two places as qcompile does not (``vllm_cpu_reference``): with an FP8
KV cache its tokens are therefore compared with the artifact's own greedy decode under those
roundings, not with qcompile's engine (they part within a few tokens; docs/DEPLOY.md says why).
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
from vllm_helpers import FP8, FP8_KV, INT4, ROOT, VLLM_PYTHON, compile_for, save_checkpoint, vllm_cpu_reference

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
          "llama-fp8-kv": ("llama", FP8_KV)}
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
# Where activations are FP8, a float difference of 1e-6 upstream (another summation order) can move
# an activation to the neighbouring FP8 code. Measured on qwen2-fp8: one such flip in layer 1's o_proj
# moved one position's log p by 0.029 while the median error stayed 5e-7; a wrong rounding of the KV
# cache moved the median by 0.15. So these models pass when the median error is within the floor and
# no position is off by more than FP8_CODE_FLIP.
FP8_CODE_FLIP = 0.1


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


def _greedy_decode(model, prompt: list[int]) -> list[int]:
    """TOKENS greedy tokens of ``model`` after ``prompt``, one full forward per token."""
    ids = []
    with torch.no_grad():
        for _ in range(TOKENS):
            ids.append(int(model(torch.tensor([prompt + ids]))[0, -1].argmax()))
    return ids


def _compare_with_engine(artifact: Path, url: str, model_name: str) -> dict:
    """vLLM's greedy tokens against qcompile's engine (with an FP8 KV cache: against the artifact's greedy
    decode under vLLM's CPU roundings), its prompt log-probabilities against the artifact's math in float32."""
    loaded = load_artifact(artifact)
    dtype = loaded.manifest["dtype"]
    reference = vllm_cpu_reference(loaded.model)  # the artifact's math in float32, rounded where vLLM's CPU kernels round
    if loaded.manifest.get("kv_cache"):
        expected, judge = [_greedy_decode(reference, p) for p in PROMPTS], reference
    else:
        expected, judge = _tokens(EngineAdapter.from_artifact(artifact)), loaded.model
    served = _tokens(OpenAIAdapter(url, model_name))
    problems = [why for p, a, b in zip(PROMPTS, expected, served) if (why := _first_disagreement(judge, p, a, b, TIE[dtype]))]
    assert not problems, problems
    window = list(range(3, 67))
    exact = _window_logprobs(reference, window)
    own_float32 = _window_logprobs(copy.deepcopy(loaded.model).float(), window)
    engine_err = float((_window_logprobs(loaded.model, window) - own_float32).abs().max())  # qcompile's own rounding
    errors = (torch.tensor(window_logprobs(url, model_name, window)) - exact).abs()
    err, median = float(errors.max()), float(errors.median())
    result = {"max_logprob_error": err, "median_logprob_error": median, "engine_max_logprob_error": engine_err}
    if any(fmt.get("activation_scheme") in ("dynamic", "static") for fmt in loaded.manifest["modules"].values()):
        assert median < LOGPROB_FLOOR[dtype] and err < FP8_CODE_FLIP, f"vLLM's prompt log-probabilities differ: {result}"
    else:
        bound = max(LOGPROB_ROUNDING * engine_err, LOGPROB_FLOOR[dtype])
        assert err < bound, f"vLLM's prompt log-probabilities differ from float32 by up to {err:.4f} (engine: {engine_err:.4f})"
    return result


@pytest.mark.parametrize("name", ["llama-int4", "qwen2-int4", "qwen2-fp8"])
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


def test_qcompile_serve_engine_vllm_and_bench_openai(exported, tmp_path):
    """``qcompile serve CHECKPOINT --engine vllm``: ready line, greedy parity, a bench run, a clean SIGTERM stop."""
    from backends.triton.runtime import free_port

    artifact, checkpoint = exported["llama-fp8-kv"]
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
