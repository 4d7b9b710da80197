"""benchmarks/engine_vs_peers.py: a runtime that fails or runs past its time is a row with its error
(the run goes on), ratios are against the first row, and the plot marks a missing figure."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest_plugins = ["bench_scripts"]  # the fixtures: run_script, tiny_artifact, tiny_int4_artifact


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("engine_vs_peers", ROOT / "benchmarks" / "engine_vs_peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_int8_artifacts_each_get_an_engine_row_and_vllm_serves_those_it_can(peers, monkeypatch):
    monkeypatch.setattr(peers, "run_engine", lambda artifact, args, plan=None: f"engine {artifact}")
    monkeypatch.setattr(peers, "run_vllm", lambda artifact, args, eager=False: f"vLLM {artifact}")
    args = peers.parser().parse_args(["--float", "F", "--int8", "S", "--int8-asymmetric", "A", "--int8-rotated", "R",
                                      "--int8-c8", "C", "--vllm"])
    assert [(label, measure()) for label, measure in peers.runtimes(args)] == [
        ("qcompile float32", "engine F"), ("qcompile INT8 W8A8", "engine S"), ("qcompile INT8 W8A8, asymmetric", "engine A"),
        ("qcompile INT8 W8A8, asymmetric, rotated", "engine R"), ("qcompile INT8 W8A8 + INT8 KV cache", "engine C"),
        ("vLLM CPU float32", "vLLM F"), ("vLLM CPU INT8 W8A8", "vLLM S"), ("vLLM CPU INT8 W8A8, asymmetric", "vLLM A"),
        ("vLLM CPU INT8 W8A8, asymmetric, rotated", "vLLM R")]  # vLLM takes no INT8 KV cache


def test_a_runtime_past_its_time_becomes_an_error(peers):
    def hangs():
        time.sleep(5)
        return {"ms_per_token_c1": 1.0, "tok_s_c16": 1.0}

    started = time.monotonic()
    assert peers.measure_within(hangs, 1) == {"error": "RuntimeTimeout: ran past --runtime-timeout 1 s"}
    assert time.monotonic() - started < 3


def test_a_failing_runtime_becomes_an_error(peers):
    def fails():
        raise OSError("no such server\nsecond line")

    assert peers.measure_within(fails, 10) == {"error": "OSError: no such server"}


def test_rows_average_rounds_and_compare_with_the_first(peers):
    rows = peers.table_rows({
        "float": [{"ms_per_token_c1": 30.0, "tok_s_c16": 100.0}, {"ms_per_token_c1": 34.0, "tok_s_c16": 120.0}],
        "int4": [{"ms_per_token_c1": 16.0, "tok_s_c16": 220.0}, {"error": "OSError: x"}],
        "broken": [{"error": "RuntimeTimeout: y"}],
    })
    assert [r["speedup_c1_vs_float"] for r in rows] == [1.0, 2.0, None]
    assert [r["throughput_c16_vs_float"] for r in rows] == [1.0, 2.0, None]
    assert rows[1]["errors"] == ["OSError: x"] and rows[2]["ms_per_token_c1"] is None


def test_plot_draws_rows_without_a_figure(peers, tmp_path):
    pytest.importorskip("matplotlib")
    rows = peers.table_rows({"float": [{"ms_per_token_c1": 30.0, "tok_s_c16": 100.0}],
                             "llama.cpp": [{"ms_per_token_c1": 8.0, "tok_s_c16": None}],
                             "broken": [{"error": "RuntimeTimeout: y"}]})
    peers.plot(rows, tmp_path / "plots" / "peers.png")
    assert (tmp_path / "plots" / "peers.png").read_bytes()[:4] == b"\x89PNG"


def test_smoke_engine_and_onnx_rows(run_script, tiny_artifact, tiny_int4_artifact, tmp_path):
    """The script on the tiny model: float, INT4 as W4A8 and W4A16 in the engine, INT4 lowered to ONNX
    Runtime (the peers that need vLLM, llama.cpp or onnxruntime-genai are left out)."""
    doc = run_script("engine_vs_peers", "--float", tiny_artifact, "--int4", tiny_int4_artifact, "--w4a16", "--onnx",
                     "--prompt-len", 8, "--output-len", 4, "--single-requests", 2, "--threads", 1,
                     "--work-dir", tmp_path, "--json", tmp_path / "out.json", "--plot", tmp_path / "out.png")
    rows = {r["runtime"]: r for r in doc["rows"]}
    assert list(rows) == ["qcompile float32", "qcompile AWQ INT4, W4A8", "qcompile AWQ INT4, W4A16",
                          "qcompile AWQ INT4 → ONNX Runtime"]
    assert all(r["errors"] == [] and r["ms_per_token_c1"] > 0 and r["tok_s_c16"] > 0 for r in rows.values())
    assert rows["qcompile float32"]["speedup_c1_vs_float"] == 1.0
    assert (tmp_path / "out.png").is_file() and doc["schema"] == "qcompile.benchmark"
