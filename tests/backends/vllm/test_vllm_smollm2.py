"""SmolLM2-135M, AWQ g128 with the group-size fallback, exported for vLLM: its perplexity on the
pydoc protocol (16 × 512 windows, ``calib.protocol``) as vLLM's prompt log-probabilities give it
and as ``qcompile eval`` gives it for the artifact must agree within 0.5%.

The pipeline is examples/awq_g128.toml in float16 (vLLM's INT4 kernels take no float32, and its
CPU bfloat16 W4A16 kernel dies of an illegal instruction on this machine). Both
figures are printed; docs/BENCHMARKS.md records them.
"""
from __future__ import annotations

import tomllib

import pytest
from vllm_helpers import ROOT, VLLM_PYTHON

pytestmark = [pytest.mark.slow, pytest.mark.integration,
              # Not yet run to completion (issue 22): AWQ of SmolLM2 in float16 took over 15 min on the
              # shared machine and was stopped; remove this mark once it has passed by hand.
              pytest.mark.skip(reason="not yet run to completion here; see issue 22's note")]


def test_smollm2_awq_perplexity_on_vllm_matches_qcompile_eval(tmp_path):
    import backends  # noqa: F401
    import passes  # noqa: F401
    from backends.triton.runtime import free_port
    from backends.vllm.evaluate import server_perplexity
    from backends.vllm.runtime import VllmOptions, VllmServer
    from calib import evaluation_windows
    from compiler.deploy.lowering import lower
    from compiler.io.artifact import load_artifact
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model
    from compiler.pipeline.evaluate import corpus_split, evaluate_perplexity

    assert VLLM_PYTHON.exists(), "vLLM is not installed; run scripts/setup_vllm.sh"
    pipeline = tomllib.loads((ROOT / "examples" / "awq_g128.toml").read_text())
    pipeline["model"]["dtype"] = "float16"
    pipeline["target"] = {"name": "vllm"}
    artifact = compile_model("smollm2", PipelineConfig.from_dict(pipeline), tmp_path / "awq").path
    checkpoint = lower(artifact, "vllm", tmp_path / "awq-vllm")
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
