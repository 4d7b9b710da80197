"""Smoke tests of the scripts that measure serving through ``qcompile bench``: serving_throughput.py,
serving_prefix.py, triton_overhead.py and kv_waste.py, on the tiny model."""
from __future__ import annotations

import json

import pytest

pytest_plugins = ["bench_scripts"]  # the fixtures: run_script, tiny_model, tiny_artifact


def test_serving_throughput(run_script, tiny_model, tmp_path):
    doc = run_script("serving_throughput", "--model", tiny_model, "--requests", 4, "--baseline-requests", 2,
                     "--prompt-len", 8, "--output-len", 4, "--json", tmp_path / "out.json")
    (row,) = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert row["engine_tok_s"] > 0 and row["baseline_tok_s"] > 0 and row["engine_output_length_mismatch"] == 0
    assert doc["bench"]["schema"] == "qcompile.bench" and doc["bench"]["runs"][0]["label"] == "concurrency 4"


def test_serving_prefix_serves_the_prefix_from_the_cache(run_script, tiny_artifact):
    doc = run_script("serving_prefix", "--model", tiny_artifact, "--requests", 4, "--prefix-len", 256,
                     "--suffix-len", 8, "--output-len", 2)
    off, on = doc["rows"]
    assert (off["prefix_caching"], on["prefix_caching"]) == (False, True)
    assert off["prompt_tokens_from_cache"] == 0 and on["prompt_tokens_from_cache"] > 0
    assert on["prompt_tokens"] == off["prompt_tokens"] == 4 * (256 + 8)  # more than one step's 512: the last ones hit


def test_triton_overhead_in_process_rows(run_script, tiny_artifact, tmp_path):
    doc = run_script("triton_overhead", tiny_artifact, "--requests", 2, "--concurrency", 2, "--prompt-len", 8,
                     "--output-len", 3, "--no-triton", "--workdir", tmp_path)
    assert [r["adapter"] for r in doc["rows"]] == ["in-process engine (before)", "in-process engine (after)"]
    assert all(r["requests"] == 2 and r["tokens"] == 6 and r["itl_p50_ms"] > 0 for r in doc["rows"])


@pytest.mark.integration
def test_triton_overhead_through_triton(run_script, tiny_artifact, tmp_path):
    from backends.triton.runtime import TritonServerError, find_install

    try:
        find_install()
    except TritonServerError as e:
        pytest.skip(f"no Triton server here: {e}")
    doc = run_script("triton_overhead", tiny_artifact, "--requests", 2, "--concurrency", 2, "--prompt-len", 8,
                     "--output-len", 3, "--workdir", tmp_path)
    assert [r["adapter"] for r in doc["rows"]][1:3] == ["Triton gRPC stream", "Triton HTTP generate_stream"]
    assert all(r["requests"] == 2 and r["tokens"] == 6 for r in doc["rows"])


def test_kv_waste(run_script, tmp_path):
    doc = run_script("kv_waste", "--steps", 60, "--warmup", 20, "--num-blocks", 256, "--json", tmp_path / "out.json")
    (row,) = doc["rows"]
    assert 0 <= row["paged_waste_pct"] < row["contiguous"]["1000"]["waste_pct"]
