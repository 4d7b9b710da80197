"""Smoke tests of the CPU kernel and decode-step timings: dense_cpu.py, int4_cpu.py, paged_decode_cpu.py,
engine_decode_steps.py, onnx_decode.py and cpu_layers_bandwidth.py, at their smallest sizes."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["bench_scripts"]  # the fixtures: run_script, tiny_model, tiny_artifact, tiny_int4_artifact


def test_dense_cpu(run_script, tmp_path):
    doc = run_script("dense_cpu", "--layers", 1, "--rows", "1,4", "--repeats", 2, "--modules", "--int4", "--int8",
                     "--json", tmp_path / "out.json")
    assert [r["rows"] for r in doc["rows"]] == [1, 4]
    for row in doc["rows"]:
        for way in ("mkl", "onednn", "qcompile", "packed_linear", "fp8_linear", "int4_w4a16", "int4_w4a8",
                    "w8a8_qcompile", "w8a8_int_mm"):
            assert 0 < row[way]["ms"] <= row[way]["p90_ms"], way


def test_int4_cpu(run_script):
    doc = run_script("int4_cpu", "--threads", 1, "--tokens", "1,300", "--shapes", "128x256g64", "--min-time", 0.001,
                     "--repeats", 2)
    one, many = doc["rows"]
    assert one["kernel_ms"] > 0 and many["kernel_ms"] is None  # from 256 tokens INT4 takes the reference
    assert all(r["reference_ms"] > 0 and r["float_ms"] > 0 for r in doc["rows"])


def test_paged_decode_cpu(run_script):
    doc = run_script("paged_decode_cpu", "--threads", 1, "--seqs", 2, "--context", 20, "--layers", 2, "--repeats", 2)
    assert [r["cache_dtype"] for r in doc["rows"]] == ["float32", "bfloat16", "float8_e4m3fn"]
    assert all(r["kernel_ms"] > 0 and r["rel_error"] < 1e-2 for r in doc["rows"])


def test_engine_decode_steps(run_script, tiny_artifact, tiny_int4_artifact):
    doc = run_script("engine_decode_steps", tiny_artifact, f"{tiny_int4_artifact}:w4a8", "--conc", "1,2", "--steps", 3,
                     "--prompt-len", 8)
    assert {(r["model"], r["concurrency"]) for r in doc["rows"]} == {
        (str(m), c) for m in (tiny_artifact, f"{tiny_int4_artifact}:w4a8") for c in (1, 2)}
    assert all(r["steps"] == 3 and 0 < r["thread_cpu_ms"] <= r["thread_cpu_p90_ms"] for r in doc["rows"])


def test_onnx_decode(run_script, tiny_model):
    doc = run_script("onnx_decode", "--model", tiny_model, "--tokens", 2, "--repeats", 2, "--threads", 1,
                     "--attention", "gqa,standard")
    rows = {r["runtime"]: r for r in doc["rows"]}
    assert len(rows) == 8 and rows["torch float32"]["speedup_vs_torch"] == 1.0
    assert rows["ONNX float32, GroupQueryAttention"]["rel_error"] < 1e-4
    assert all(r["ms_per_token"] > 0 for r in rows.values())


TINY_LAYERS = dict(dim=64, intermediate_size=128, n_layers=2, n_heads=4, n_kv_heads=2)


def with_tiny_layers(module) -> None:
    module.MODELS["tiny"] = TINY_LAYERS


def test_cpu_layers_bandwidth(run_script, tmp_path):
    doc = run_script("cpu_layers_bandwidth", "--threads", 1, "--models", "tiny", "--formats", "float32,int4-g32-w4a8,fp8",
                     "--rows", "1,2", "--context", 16, "--repeats", 2, "--bandwidth-gib", 0.01,
                     "--plot", tmp_path / "out.png", prepare=with_tiny_layers)
    assert [r["format"] for r in doc["rows"]] == ["float32", "int4-g32-w4a8", "fp8"]
    assert all(r["rows_1"]["ms"] > 0 and r["rows_2"]["share_of_bandwidth"] > 0 for r in doc["rows"])
    assert doc["bandwidth_gb_s"] > 0 and (tmp_path / "out.png").is_file()


def test_cpu_layers_bandwidth_llama_cpp_rows(run_script, monkeypatch, tmp_path):
    """The llama.cpp rows: the same tiny weights written as GGUF and timed by llama-cpp-python (the build of
    scripts/setup_llama_cpp.sh, its binding from this environment)."""
    import importlib.util

    from backends.gguf.llama_cpp import library_dir, missing_reason

    if why := missing_reason():
        pytest.skip(why)
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(library_dir()))
    binding = Path(importlib.util.find_spec("llama_cpp").origin).parents[1]
    doc = run_script("cpu_layers_bandwidth", "--threads", 1, "--models", "tiny", "--formats", "float32", "--rows", 1,
                     "--context", 16, "--repeats", 2, "--bandwidth-gib", 0.01, "--work-dir", tmp_path,
                     "--llama-cpp-path", binding, prepare=with_tiny_layers)
    assert [r["format"] for r in doc["rows"]] == ["float32", "llama.cpp F32", "llama.cpp Q4_0"]
    assert all(r["rows_1"]["ms"] > 0 for r in doc["rows"])
