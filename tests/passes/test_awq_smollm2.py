"""Slow: AWQ INT4 g128-fallback on the real SmolLM2-135M at 32 calibration samples (the main job's
pipeline, examples/awq_g128.toml), whose pydoc perplexity (16 windows) must stay within a small band
of the recorded figure. A quality regression in the pass moves it far beyond the band: RTN at the
same group sizes is 15.142, plain AWQ rounding at
32 samples 12.967 (float32 scales), float 11.327.

RECORDED_PPL was measured twice, bit for bit the same (12.198185761895706), on this 2-core development
machine (2026-12-05 20:40 and 20:55 UTC, with INT4 scales kept to float16's precision; 12.2947 before
that, twice); the band absorbs float differences on other machines (thread counts change the order of
GPTQ's sums): scales perturbed by 2^-20 moved the figure by 0.003.
"""
from __future__ import annotations

import pytest

import passes  # noqa: F401  (registers awq)
from compiler.io.artifact import load_artifact
from compiler.pipeline import PipelineConfig
from compiler.pipeline.compile import compile_model
from compiler.pipeline.evaluate import evaluate_perplexity
from qcompile.cli.example import example_pipeline

RECORDED_PPL = 12.198
BAND = 0.05  # perplexity; 0.4% of the figure, a sixth of what GPTQ rounding gained over plain AWQ at 32 samples


@pytest.mark.slow
def test_awq_g128_32_samples_perplexity_in_band(tmp_path):
    config = PipelineConfig.from_toml(example_pipeline("awq_g128.toml"))
    assert config.calibration.samples == 32 and config.passes[0]["group_size"] == 128
    result = compile_model("smollm2", config, tmp_path / "awq")
    ppl = evaluate_perplexity(load_artifact(result.path))["ppl"]
    print(f"AWQ g128-fallback, 32 samples: pydoc perplexity {ppl:.3f} (recorded {RECORDED_PPL})")
    assert abs(ppl - RECORDED_PPL) <= BAND, f"perplexity {ppl:.3f} left the band {RECORDED_PPL} ± {BAND}"
