"""SmolLM2-135M, AWQ g128 with the group-size fallback, exported for vLLM: its perplexity on the
pydoc protocol (16 × 512 windows, ``calib.protocol``) as vLLM's prompt log-probabilities give it
and as ``qcompile eval`` gives it for the artifact must agree within 0.5%.

The pipeline is examples/awq_g128_vllm.toml: examples/awq_g128.toml in float16 (vLLM's INT4
kernels take no float32, and its CPU bfloat16 W4A16 kernel dies of an illegal instruction on this
machine) with the vllm target. Both figures are printed; docs/notes/2026-12-entry-vllm-exported-checkpoint.md records them. Where
vLLM's build on this host has no W4A16 kernel (its AVX2 build), vLLM is checked to fail on the
export for want of that kernel only, and compressed-tensors' decompressor to give back the
artifact's weights.

The AWQ compile takes from ten minutes (a quiet machine) to an hour (a shared one): set
QCOMPILE_SMOLLM2_AWQ_FP16 to an artifact compiled from this very pipeline to reuse it (its
manifest's pipeline must equal the test's, or the test fails).
"""
from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
from vllm_helpers import ROOT, VLLM_PYTHON, assert_decompresses_to_the_artifact, assert_vllm_refuses_int4, vllm_here

pytestmark = [pytest.mark.slow, pytest.mark.integration]
PREBUILT = "QCOMPILE_SMOLLM2_AWQ_FP16"


def _artifact(pipeline: dict, out: Path) -> Path:
    """The artifact of ``pipeline`` on SmolLM2: compiled into ``out``, or the prebuilt one named by PREBUILT."""
    from compiler.io.artifact import read_manifest
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    config = PipelineConfig.from_dict(pipeline)
    if not os.environ.get(PREBUILT):
        return compile_model("smollm2", config, out).path
    prebuilt = Path(os.environ[PREBUILT])
    recorded = read_manifest(prebuilt).pipeline
    assert recorded == config.to_dict(), f"{PREBUILT}={prebuilt} was compiled from another pipeline: {recorded}"
    return prebuilt


def test_smollm2_awq_perplexity_on_vllm_matches_qcompile_eval(tmp_path):
    import backends  # noqa: F401
    import passes  # noqa: F401
    from backends.triton.runtime import free_port
    from backends.vllm.evaluate import server_perplexity
    from backends.vllm.runtime import VllmOptions, VllmServer
    from calib import evaluation_windows
    from compiler.deploy.lowering import lower
    from compiler.io.artifact import load_artifact
    from compiler.pipeline.evaluate import corpus_split, evaluate_perplexity

    assert VLLM_PYTHON.exists(), "vLLM is not installed; run scripts/setup_vllm.sh"
    pipeline = tomllib.loads((ROOT / "examples" / "awq_g128_vllm.toml").read_text())
    artifact = _artifact(pipeline, tmp_path / "awq")
    checkpoint = lower(artifact, "vllm", tmp_path / "awq-vllm").path
    if not vllm_here().w4a16:
        assert_vllm_refuses_int4(checkpoint, tmp_path / "vllm.log")
        assert_decompresses_to_the_artifact(artifact, checkpoint, tmp_path / "decompressed.safetensors")
        return
    loaded = load_artifact(artifact)
    ours = evaluate_perplexity(loaded)
    windows = evaluation_windows(corpus_split(loaded.tokenizer, "pydoc").evaluation, 16, 512)
    opts = VllmOptions(checkpoint, port=free_port(), served_name="smollm2-awq", max_model_len=1024,
                       extra_args=["--enforce-eager"])
    with VllmServer(opts, log_path=tmp_path / "vllm.log") as server:
        theirs = server_perplexity(server.url, server.model, windows)
    print(f"SmolLM2 AWQ g128-fallback fp16, pydoc 16x512: qcompile eval {ours['ppl']:.4f}, vLLM {theirs['ppl']:.4f}")
    assert theirs["tokens"] == ours["tokens"]
    assert abs(theirs["ppl"] / ours["ppl"] - 1) < 0.005, (ours, theirs)
