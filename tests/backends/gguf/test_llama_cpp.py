"""The GGUF files run in the real llama.cpp (the build of scripts/setup_llama_cpp.sh, through
llama-cpp-python): tiny Llama, Qwen2, Qwen3 and Gemma 3 checkpoints compiled with the awq pass in
each llama.cpp format load; llama.cpp's logits agree with the engine's like-for-like reference
(its int8 activation rounding, ``llama_cpp_reference``) within ``LOGIT_BOUND``; greedy decoding
gives the same 16 tokens, or differs first where the reference's two candidates are a tie within
the measured discrepancy (random tiny models amplify llama.cpp's int8 rounding differences).
The KV cache is float32 in llama.cpp here (its default float16 cache adds ~1e-3 of its own)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_helpers_llama import ARCHS, MOE_ARCHS, compile_awq, greedy_llama_cpp, llama_cpp_reference, save_checkpoint

import backends  # noqa: F401  (registers the gguf target)
from backends.gguf.llama_cpp import import_llama_cpp, missing_reason
from compiler.deploy.lowering import lower
from compiler.io.artifact import load_artifact

pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))

FORMATS = {"gguf:q4_0": {"format": "gguf:q4_0"}, "gguf:q4_1": {"format": "gguf:q4_1"},
           "gguf:q4_k_m": {"format": "gguf:q4_k_m"}, "int4 g128 symmetric": {"group_size": 128, "zero_point": False}}
LOGIT_BOUND = 0.05  # relative L2 distance of the logits; 0.011-0.024 where measured (llama.cpp's own rounding and summation order)
# A greedy disagreement is a tie when the reference's two candidates are closer than this many
# times the measured logit discrepancy (the relative distance times the logits' spread).
TIE_DISCREPANCIES = 3.0
PROMPT = [5, 17, 42, 99, 7, 150, 33, 8, 61, 200, 12, 44]
TOKENS = 16
GGML_F32 = 0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-cpp")
    return {arch: save_checkpoint(root, arch) for arch in ARCHS}


def llama(path):
    llama_cpp = import_llama_cpp()
    return llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2,
                           type_k=GGML_F32, type_v=GGML_F32)


def greedy_reference(model, prompt: list[int]) -> list[int]:
    out = []
    with torch.no_grad():
        for _ in range(TOKENS):
            out.append(int(model(torch.tensor([prompt + out]))[0, -1].argmax()))
    return out


def first_real_disagreement(model, prompt, ours, theirs, tie: float) -> str | None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ours[:i]]))[0, -1].float()
            gap = float(logits[a] - logits[b])
            return None if gap <= tie else f"token {i}: engine {a}, llama.cpp {b}, logit gap {gap:.3f} > tie {tie:.3f}"
    return None


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_runs_the_file_as_the_engine_runs_the_artifact(checkpoints, tmp_path, arch, fmt):
    artifact = compile_awq(checkpoints[arch], tmp_path / "art", **FORMATS[fmt])
    path = lower(artifact, "gguf", tmp_path / "m.gguf").path
    reference = llama_cpp_reference(load_artifact(artifact).model)
    llm = llama(path)
    llm.reset()
    llm.eval(PROMPT)
    theirs = np.array(llm.scores[: len(PROMPT)])
    with torch.no_grad():
        ours = reference(torch.tensor([PROMPT]))[0].float().numpy()
    assert np.isfinite(theirs).all()
    rel = float(np.linalg.norm(theirs - ours) / np.linalg.norm(ours))
    assert rel < LOGIT_BOUND, f"{arch} {fmt}: llama.cpp's logits {rel:.4f} from the engine's reference"
    ours_greedy, theirs_greedy = greedy_reference(reference, PROMPT), greedy_llama_cpp(llm, PROMPT, TOKENS)
    tie = TIE_DISCREPANCIES * rel * float(ours.std())
    assert first_real_disagreement(reference, PROMPT, ours_greedy, theirs_greedy, tie) is None


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_llama_cpp_runs_stacked_experts(tmp_path, arch):
    """Qwen3-MoE and Mixtral: each layer's experts stacked per projection, the router in F32."""
    artifact = compile_awq(save_checkpoint(tmp_path, arch), tmp_path / "art", format="gguf:q4_0")
    llm = llama(lower(artifact, "gguf", tmp_path / "m.gguf").path)
    llm.eval(PROMPT)
    theirs = np.array(llm.scores[: len(PROMPT)])
    with torch.no_grad():
        ours = llama_cpp_reference(load_artifact(artifact).model)(torch.tensor([PROMPT]))[0].float().numpy()
    rel = float(np.linalg.norm(theirs - ours) / np.linalg.norm(ours))
    assert rel < LOGIT_BOUND, f"{arch}: llama.cpp's logits {rel:.4f} from the engine's reference"


def test_llama_cpp_tokenizes_as_the_artifacts_tokenizer(checkpoints, tmp_path):
    artifact = compile_awq(checkpoints["qwen2"], tmp_path / "art", format="gguf:q4_0")
    path = lower(artifact, "gguf", tmp_path / "m.gguf").path
    tokenizer = load_artifact(artifact).tokenizer
    text = "def load(path: str) -> dict:\n    return json.loads(open(path).read())  # 42 times"
    assert llama(path).tokenize(text.encode(), add_bos=False, special=False) == tokenizer(text)["input_ids"]
