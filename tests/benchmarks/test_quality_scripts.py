"""Smoke tests of the quality scripts on the tiny model: awq_quality.py, fp8_quality.py, int8_quality.py,
int4_compute_quality.py, kl_quality.py and vllm_perplexity.py (vLLM itself only where it is installed),
one window each. Their figures mean nothing on a random model: the tests check that every row is there."""
from __future__ import annotations

import json
import math
from contextlib import contextmanager

import pytest

from bench_scripts import ROOT, load_script

pytest_plugins = ["bench_scripts"]  # the fixtures: run_script, tiny_model, tiny_artifact, tiny_int4_artifact
SHORT_AWQ = ["--set", "alpha_grid=2", "--set", "clip_search=false", "--set", "module_candidates=0"]


def finite(*values) -> bool:
    return all(isinstance(v, float) and math.isfinite(v) for v in values)


def test_awq_quality(run_script, tiny_model, tmp_path):
    doc = run_script("awq_quality", "--model", tiny_model, "--groups", 64, "--methods", "awq", "--samples", 1,
                     "--windows", 1, *SHORT_AWQ, "--json", tmp_path / "out.json")
    assert [(r["method"], r["group_size"]) for r in doc["rows"]] == [("float", 0), ("awq", 64)]  # each its own process
    assert all(finite(r["ppl"], r["quant_wall_s"]) and r["peak_rss_mib"] > 0 for r in doc["rows"])


def test_fp8_quality(run_script, tiny_model):
    doc = run_script("fp8_quality", "--model", tiny_model, "--windows", 1, "--samples", 1,
                     "--only", "w8a8-dynamic", "kv-e4m3-per-head")
    assert [r["variant"] for r in doc["rows"]] == ["float", "w8a8-dynamic", "kv-e4m3-per-head"]
    assert doc["rows"][0]["kl"] < 1e-6 and all(finite(r["ppl"], r["kl"]) for r in doc["rows"])
    assert doc["rows"][1]["fp8_layers"] > 0


def test_int8_quality(run_script, tiny_model, tmp_path):
    argv = ("--model", tiny_model, "--windows", 1, "--samples", 1, "--corpora", "pydoc,stdlib-docs",
            "--json", tmp_path / "out.json")
    doc = run_script("int8_quality", *argv, "--only", "w8a8-dynamic")
    assert [(r["variant"], r["corpus"]) for r in doc["rows"]] == [
        ("float", "pydoc"), ("float", "stdlib-docs"), ("w8a8-dynamic", "pydoc"), ("w8a8-dynamic", "stdlib-docs")]
    assert all(finite(r["ppl"], r["kl"]) for r in doc["rows"]) and doc["vllm"] == []
    # a resumed run keeps the variants its file holds and compiles only the new one (rotated: rotate, then int8)
    compiled = []
    resumed = run_script("int8_quality", *argv, "--only", "w8a8-dynamic", "w8a8-dynamic-rotated",
                         prepare=lambda m: setattr(m, "compile_loaded", _recording(compiled, m.compile_loaded)))
    assert compiled == [["rotate", "int8"]] and resumed["rows"][:4] == doc["rows"]
    rotated = json.loads((tmp_path / "out.json").read_text())["rows"][4:]
    assert [r["variant"] for r in rotated] == ["w8a8-dynamic-rotated"] * 2
    assert all(r["smoothing_strength"] is not None for r in rotated)  # the int8 pass's report, not rotate's


def _recording(calls: list, compile_loaded):
    def run(loaded, config, out):
        calls.append([p["name"] for p in config.passes])
        return compile_loaded(loaded, config, out)
    return run


def test_int4_compute_quality(run_script, tiny_model, tiny_int4_artifact):
    doc = run_script("int4_compute_quality", tiny_int4_artifact, "--model", tiny_model, "--windows", 1,
                     "--corpora", "pydoc")
    w4a16, w4a8 = doc["rows"]
    assert (w4a16["compute"], w4a8["compute"]) == ("w4a16", "w4a8")
    assert w4a16["kl_vs_w4a16"] == 0.0 and finite(w4a8["kl_vs_w4a16"], w4a8["ppl"])


def test_vllm_perplexity_windows_and_row(run_script, tiny_model, monkeypatch):
    """The script's own part with vLLM's server replaced: the protocol's windows go to the server, its
    perplexity comes back as the row (the real server in the test below)."""
    import backends.vllm.evaluate
    import backends.vllm.runtime

    sent = []

    @contextmanager
    def no_server(opts, log_path):
        yield type("Server", (), {"url": "127.0.0.1:1", "model": opts.served_name})()

    def perplexity(url, model, windows):
        sent.append(tuple(windows.shape))
        return {"ppl": 10.0, "tokens": windows.shape[0] * (windows.shape[1] - 1), "nll": math.log(10.0)}

    monkeypatch.setattr(backends.vllm.runtime, "VllmServer", no_server)
    monkeypatch.setattr(backends.vllm.evaluate, "server_perplexity", perplexity)
    doc = run_script("vllm_perplexity", tiny_model, "--windows", 2)
    assert sent == [(2, 512)] and doc["rows"][0]["tokens"] == 2 * 511


@pytest.mark.integration
def test_vllm_perplexity_on_vllm(run_script, tiny_artifact, tmp_path):
    from backends.vllm.runtime import VllmServerError, vllm_python
    from compiler.deploy.lowering import lower

    try:
        vllm_python()
    except VllmServerError as e:
        pytest.skip(f"vLLM is not installed here: {e}")
    import backends  # noqa: F401  (registers the vllm target)

    checkpoint = lower(tiny_artifact, "vllm", tmp_path / "vllm").path
    doc = run_script("vllm_perplexity", checkpoint, "--windows", 1)
    assert doc["rows"][0]["tokens"] == 511 and finite(doc["rows"][0]["ppl"])


def test_kl_quality(run_script, tiny_model, tmp_path):
    argv = ("--model", tiny_model, "--samples", 1, "--windows", 1, "--corpora", "pydoc",
            "--workdir", tmp_path / "work", "--json", tmp_path / "out.json")
    run_script("kl_quality", *argv, "--recipes", "rtn:64")
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert [r["recipe"] for r in rows] == ["float", "rtn:64"]
    float_row, rtn = (r["by_corpus"]["pydoc"] for r in rows)
    assert float_row["kld_mean"] < 1e-6 < rtn["kld_mean"] and finite(rtn["ppl"])
    assert rows[1]["bits_per_weight"] > 4
    # a resumed run keeps the rows it has and adds the new recipe's
    run_script("kl_quality", *argv, "--recipes", "rtn:64,rtn:32", prepare=lambda m: setattr(m, "_child", _only("rtn:32", m._child)))
    resumed = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert resumed[:2] == rows and resumed[2]["recipe"] == "rtn:32"


def test_kl_quality_recipes_may_name_their_dtype():
    kl = load_script("kl_quality")
    table = kl.pipeline_for("mixed:4.25:bfloat16", 8)
    assert (table["model"]["dtype"], table["passes"][0]["average_bits"], table["calibration"]["samples"]) == (
        "bfloat16", 4.25, 8)
    assert kl.pipeline_for("mixed:4.5", 8)["model"]["dtype"] == "float16"  # the example's
    float_bf16 = kl.pipeline_for(str(ROOT / "examples" / "float.toml") + "::bfloat16", 8)
    assert float_bf16["model"]["dtype"] == "bfloat16" and not float_bf16.get("passes")
    assert kl.converted_bits([{"format": "bfloat16", "out_features": 4, "in_features": 4, "bytes": 32}]) is None
    rows = [{"recipe": r, "bits_per_weight": None, "by_corpus": {"pydoc": {"ppl": p, "kld_mean": 0.1,
                                                                            "kld_mean_uncertainty": 0.01, "same_top": 0.9}}}
            for r, p in (("float", 10.0), ("rtn:64", 20.0), ("awq:64:bfloat16", 12.0))]
    assert "| awq:64:bfloat16 |  | 12.000 (+20.00%) | 80% |" in kl.markdown_table(rows)  # against rtn:64


def _only(recipe: str, child):
    """``_child`` that refuses every recipe but ``recipe``: a resumed run must not recompute kept rows."""
    def run(args, name, workdir):
        assert name == recipe, f"{name} recomputed"
        return child(args, name, workdir)
    return run
