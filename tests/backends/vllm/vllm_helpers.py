"""Tiny models vLLM's CPU backend runs, compiled as INT4 or FP8 for the vllm target, the artifact's
math with vLLM's CPU roundings (``vllm_cpu_reference``), and what to check where vLLM's build on this
host cannot run an export (``assert_vllm_refuses_int4``, ``assert_decompresses_to_the_artifact``)."""
from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import types
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import make_byte_tokenizer, make_hf_model

from backends.vllm.evaluate import window_logprobs
from backends.vllm.runtime import VllmHost, VllmOptions, VllmServer, VllmServerError, vllm_host, vllm_python
from compiler.formats.fp8 import Fp8Linear
from compiler.formats.kv_quant import Fp8KVQuant
from compiler.formats.qlinear import quantized_modules
from compiler.io.artifact import load_artifact
from compiler.quant.fp8 import fp8_max, scale_from_amax
from serving.adapters.engine import EngineAdapter
from serving.adapters.openai import OpenAIAdapter
from serving.engine import Engine
from serving.types import SamplingParams

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# TEST DOUBLE of VLLM_PYTHON: the real vLLM, seeing an AVX2-only CPU (it loads its _C_AVX2 build).
AVX2_DOUBLE = ROOT / "tests" / "doubles" / "vllm_avx2_host" / "python"
# head_dim 32: vLLM's CPU attention takes head sizes 32, 64, 80, … (not the fixtures' 16); every
# linear's sizes (64, 32, 96) are multiples of 32, as its CPU INT4 kernel needs.
SHAPE = dict(num_attention_heads=2, num_key_value_heads=1)
CALIBRATION = {"samples": 4, "seq_len": 64}
# Group 64 where it divides (q/k/v/o, gate/up: 64 inputs), the fallback 32 on down_proj (96 inputs):
# two config groups. vLLM's INT4 kernels take float16 or bfloat16 activations, not float32; on this
# machine's CPU its bfloat16 W4A16 kernel (AMX) dies of an illegal instruction, float16 runs.
INT4 = {"model": {"dtype": "float16"}, "passes": [{"name": "awq", "group_size": 64}]}
# FP8 W8A8 (per-channel weights, dynamic per-token activations), and the same with an FP8 KV cache
# (one scale per layer). max_layer_error is raised so that no layer of the random model falls back to float.
FP8 = {"passes": [{"name": "fp8", "input_shift": False, "max_layer_error": 10.0}]}
# INT8 W8A8 (SmoothQuant at a fixed strength, GPTQ, per-channel weights): dynamic symmetric per-token
# activations, dynamic asymmetric ones (vLLM's azp), and static asymmetric per-tensor ones.
INT8 = {"passes": [{"name": "int8", "smoothing_strength": 0.5}]}
INT8_ASYMMETRIC = {"passes": [{**INT8["passes"][0], "activation_symmetric": False}]}
INT8_STATIC = {"passes": [{**INT8["passes"][0], "activation_scheme": "static"}]}
# The same after the rotate pass (on a tied checkpoint: the export writes the untied head it makes).
INT8_ROTATED = {"passes": [{"name": "rotate"}, INT8["passes"][0]]}
FP8_KV = {"passes": [{**FP8["passes"][0], "kv_cache_dtype": "float8_e4m3fn", "kv_cache_granularity": "per_tensor"}]}


def save_checkpoint(root: Path, arch: str, tokenizer=None, **overrides) -> Path:
    """A tiny random ``arch`` checkpoint of vLLM-friendly shape, with the byte-level tokenizer beside it."""
    tokenizer = tokenizer or make_byte_tokenizer()
    model = make_hf_model(arch, vocab_size=len(tokenizer), **{**SHAPE, **overrides})
    path = root / f"ckpt-{arch}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def compile_for(checkpoint: Path, pipeline: dict, out: Path, target: str | None = "vllm") -> Path:
    """Compile ``checkpoint`` with ``pipeline`` (a dict like INT4) into the artifact ``out``."""
    import backends  # noqa: F401  (the vllm target, checked by the pipeline)
    import passes  # noqa: F401
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    config = {"calibration": CALIBRATION, **pipeline}
    if target:
        config["target"] = {"name": target}
    return compile_model(checkpoint, PipelineConfig.from_dict(config), out).path


def _cast_toward_zero(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 codes of ``x`` (saturated) rounded toward zero: torch rounds to nearest, then steps back a code where that grew |x|."""
    x = x.float().clamp(-fp8_max(dtype), fp8_max(dtype))
    nearest = x.to(dtype)
    grew = nearest.float().abs() > x.abs()  # never at code 0, so the step below never wraps
    return torch.where(grew, (nearest.view(torch.uint8) - 1).view(dtype), nearest)


class _TruncatingKVQuant(Fp8KVQuant):
    """The FP8 KV round trip as vLLM 0.32's CPU attention writes its cache (codes rounded toward zero)."""

    def forward(self, k, v):
        if self.dtype_name != "float8_e4m3fn":
            raise ValueError("vLLM's CPU KV rounding was measured for float8_e4m3fn only")
        dtype = torch.float8_e4m3fn
        ks, vs = self.k_scale.reshape(1, -1, 1, 1), self.v_scale.reshape(1, -1, 1, 1)
        return ((_cast_toward_zero(k / ks, dtype).float() * ks).to(k.dtype),
                (_cast_toward_zero(v / vs, dtype).float() * vs).to(v.dtype))


def _quantize_rows_by_reciprocal(self: Fp8Linear, x: torch.Tensor):
    """Dynamic per-token FP8 codes as vLLM's ``QuantFP8`` makes them: x times the reciprocal of the scale."""
    scale = scale_from_amax(x.float().abs().amax(dim=-1), self.format.activation_torch_dtype)
    codes = (x.float() * scale.reciprocal()[:, None]).clamp(-fp8_max(self.format.activation_torch_dtype),
                                                            fp8_max(self.format.activation_torch_dtype))
    return codes.to(self.format.activation_torch_dtype), scale


def vllm_cpu_reference(model: torch.nn.Module) -> torch.nn.Module:
    """A float32 copy of the artifact's ``model`` that rounds where vLLM 0.32 on the CPU rounds.

    Two roundings differ from qcompile's own (both measured against vLLM on the tiny models here):
    its CPU attention (``cpu_attn_reshape_and_cache``) writes FP8 KV codes rounded toward zero, where
    torch, compressed-tensors and qcompile round to nearest; and its activation quantizer multiplies
    by the scale's reciprocal where qcompile divides (one ulp apart, enough to flip an FP8 code now and
    then). With both, vLLM's prompt log-probabilities equal this model's to 2e-6 on qwen2 FP8 + FP8 KV.
    INT4 models and FP8 models without a KV cache come back unchanged but for the float32 copy.
    """
    ref = copy.deepcopy(model).float()
    for module in ref.modules():
        if isinstance(module, Fp8Linear) and module.format.dynamic:
            if module.input_shift is not None or module.outlier_index is not None or module.format.activation_group_size:
                raise ValueError("vllm_cpu_reference models plain per-token FP8 activations only")
            module.quantize_input = types.MethodType(_quantize_rows_by_reciprocal, module)
    for layer in ref.layers:
        quant = layer.self_attn.kv_quant
        if quant is not None:
            layer.self_attn.kv_quant = _TruncatingKVQuant(quant.dtype_name, quant.k_scale, quant.v_scale)
    return ref


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
# cache moved the median by 0.15. On qwen3-fp8 (q/k norms sharpen it) one flip at position 58 of 63
# moved that position and the four after it (they attend to it) by up to 0.12, the rest within 2e-6.
# So these models pass when at least FP8_EXACT_SHARE of the positions are within the floor (the median
# and more: a wrong scale or rounding moves every position) and none is off by more than FP8_CODE_FLIP.
FP8_EXACT_SHARE = 0.85
FP8_CODE_FLIP = 0.25


def vllm_here() -> VllmHost:
    """What the vLLM the tests start runs on this host (QCOMPILE_VLLM_PYTHON=AVX2_DOUBLE makes it an AVX2 host's)."""
    return vllm_host(vllm_python())


def tiny_server(checkpoint: Path, log: Path, python: Path | None = None) -> VllmServer:
    from backends.triton.runtime import free_port

    opts = VllmOptions(checkpoint, port=free_port(), served_name="tiny", extra_args=["--enforce-eager"])
    return VllmServer(opts, log_path=log, python=python)


def start_server(checkpoint: Path, log: Path) -> VllmServer:
    return tiny_server(checkpoint, log).start()


def assert_log_shows(log: Path, *reasons: str) -> None:
    text = log.read_text(errors="replace")
    missing = [r for r in reasons if r not in text]
    assert not missing, f"vLLM failed, but its log {log} does not show {missing}:\n{text[-3000:]}"


def assert_vllm_fails_to_start(server: VllmServer, *reasons: str) -> None:
    """vLLM, started past qcompile's up-front host check, exits before it serves, and its log shows each of ``reasons``."""
    try:
        with pytest.raises(VllmServerError, match="exited with code"):
            server.start(check_host=False)
    finally:
        server.stop()
    assert_log_shows(server.log_path, *reasons)


# What vLLM's AVX2 build does with an INT4 layer: it picks its CPU W4A16 kernel, whose op is not in that build.
NO_W4A16_OP = ("Using CPUWNA16LinearKernel", "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'")


def assert_vllm_refuses_int4(checkpoint: Path, log: Path, python: Path | None = None) -> None:
    """Where vLLM's build has no W4A16 op (_C_AVX2), vLLM itself, started past qcompile's up-front host check,
    picks its CPU W4A16 kernel for the INT4 layers and fails at the first forward for want of that op, not for
    anything in the export. With --enforce-eager vLLM runs no warm-up forward, so that is the first request's."""
    server = tiny_server(checkpoint, log, python)
    try:
        server.start(check_host=False)
        request = urllib.request.Request(f"http://{server.url}/v1/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": server.model, "prompt": [5, 6, 7], "max_tokens": 1}).encode())
        with pytest.raises(urllib.error.HTTPError, match="500"):
            urllib.request.urlopen(request, timeout=300)
    finally:
        server.stop()
    assert_log_shows(log, *NO_W4A16_OP)


def assert_decompresses_to_the_artifact(artifact: Path, checkpoint: Path, out: Path) -> None:
    """compressed-tensors' own decompressor (``ct_decompress.py``, run by vLLM's python) gives back the
    artifact's dequantized weights bit for bit, in the checkpoint's dtype (as vLLM takes them)."""
    from safetensors.torch import load_file

    subprocess.run([str(VLLM_PYTHON), str(Path(__file__).with_name("ct_decompress.py")), str(checkpoint), str(out)],
                   check=True, capture_output=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                   timeout=600)
    decompressed = load_file(str(out))
    dtype = json.loads((checkpoint / "config.json").read_text())["dtype"]
    modules = quantized_modules(load_artifact(artifact).model.to(getattr(torch, dtype)))
    assert set(decompressed) == {f"model.{n}" for n in modules}
    for n, module in modules.items():
        assert torch.equal(decompressed[f"model.{n}"], module.dequantized_weight()), (checkpoint, n)  # bit for bit


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


def _as_served(artifact: Path, dtype: str | None):
    """The artifact loaded, its model in ``dtype`` (the checkpoint's) when given: how vLLM takes it."""
    loaded = load_artifact(artifact)
    if dtype is not None:
        loaded.model.to(getattr(torch, dtype))
    return loaded


def compare_with_engine(artifact: Path, url: str, model_name: str, dtype: str | None = None) -> dict:
    """vLLM's greedy tokens against qcompile's engine (with an FP8 KV cache: against the artifact's greedy
    decode under vLLM's CPU roundings), its prompt log-probabilities against the artifact's math in float32.
    ``dtype``: the checkpoint's, where it is not the artifact's (a float32 artifact with INT4 layers is
    written in float16); the artifact is then taken in that dtype, as vLLM runs it."""
    loaded = _as_served(artifact, dtype)
    dtype = loaded.manifest.dtype_name if dtype is None else dtype
    reference = vllm_cpu_reference(loaded.model)  # the artifact's math in float32, rounded where vLLM's CPU kernels round
    if loaded.manifest.kv_cache:
        expected, judge = [_greedy_decode(reference, p) for p in PROMPTS], reference
    else:
        # W4A16, as vLLM computes INT4 (the engine's default on a CPU is W4A8)
        engine = Engine.from_loaded(_as_served(artifact, dtype), int4_compute="w4a16")
        expected, judge = _tokens(EngineAdapter(engine)), loaded.model
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
    if any(fmt.get("activation_scheme") in ("dynamic", "static") for fmt in loaded.manifest.modules.values()):
        within = float((errors < LOGPROB_FLOOR[dtype]).float().mean())
        result["share_within_floor"] = within
        assert within >= FP8_EXACT_SHARE and err < FP8_CODE_FLIP, f"vLLM's prompt log-probabilities differ: {result}"
    else:
        bound = max(LOGPROB_ROUNDING * engine_err, LOGPROB_FLOOR[dtype])
        assert err < bound, f"vLLM's prompt log-probabilities differ from float32 by up to {err:.4f} (engine: {engine_err:.4f})"
    return result
