"""``qcompile bench`` against the real in-process engine on a tiny compiled artifact: counts must match."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from compiler.kernels.cpu_ext import cpu_isa_in_use
from compiler.kernels.cpu_isa import host_levels
from compiler.pipeline import PipelineConfig
from compiler.pipeline.compile import compile_model

FLOAT_PIPELINE = Path(__file__).resolve().parents[3] / "examples" / "float.toml"


@pytest.fixture
def tiny_artifact(tmp_path, tiny_checkpoint_with_tokenizer):
    path, _ = tiny_checkpoint_with_tokenizer("llama")
    return compile_model(str(path), PipelineConfig.from_toml(FLOAT_PIPELINE), tmp_path / "artifact", False, False).path


def test_bench_engine_counts_tokens_and_requests(tiny_artifact, tmp_path, monkeypatch, capsys):
    from qcompile.cli import main

    out = tmp_path / "engine.json"
    monkeypatch.setattr(sys, "argv", ["qcompile", "bench", str(tiny_artifact), "--concurrency", "1,3", "--num-requests", "6",
                                      "--warmup", "1", "--prompt-len", "uniform:8:20", "--output-len", "5",
                                      "--output-json", str(out)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code in (0, None), capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["adapter"] == "engine" and result["environment"]["artifact_manifest_sha256"]
    # what the engine ran, with the ISA level of qcompile's CPU kernels, and the levels this CPU has
    assert result["workload"]["engine_kernels"]["isa"] == cpu_isa_in_use()
    assert result["environment"]["hardware"]["cpu_isa_levels"] == list(host_levels())
    for run in result["runs"]:
        counts = run["metrics"]["counts"]
        assert counts["requests"] == counts["successful"] == 6 and counts["failed"] == 0
        assert counts["output_tokens"] == 30 and counts["output_length_mismatch"] == 0
        for q in run["requests"]:
            assert q["output_tokens"] == sum(q["chunk_tokens"]) == 5 and q["finish_reason"] == "length"
            assert 8 <= q["input_tokens"] <= 20
            assert q["time_to_first_token_ms"] <= q["request_latency_ms"]
        assert run["metrics"]["time_per_output_token"]["count"] == 6


def test_example_latency_stage_runs_on_an_artifact(tiny_artifact):
    from rich.console import Console

    from qcompile.cli.bench import bench_stage

    console = Console(record=True, width=200)
    result = bench_stage(console, str(tiny_artifact))
    assert [r["load"]["concurrency"] for r in result["runs"]] == [1, 4]
    assert all(r["metrics"]["counts"]["output_tokens"] == 4 * 8 for r in result["runs"])
    assert "concurrency 4" in console.export_text()
