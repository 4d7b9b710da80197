"""The public Python API (``import qcompile``) on a tiny checkpoint with a tokenizer, as the README shows it."""
from __future__ import annotations

import math

import pytest
import torch

import qcompile
from compiler.errors import ConfigError, QCompileError

AWQ_PIPELINE = {"calibration": {"samples": 4, "seq_len": 32},
                "passes": [{"name": "awq", "group_size": 32, "alpha_grid": 4, "clip_grid": 4, "module_candidates": 0}]}


@pytest.fixture
def checkpoint(tiny_checkpoint_with_tokenizer):
    path, hf = tiny_checkpoint_with_tokenizer()
    return path, hf


def test_compile_load_evaluate_generate_inspect_lower(checkpoint, tmp_path):
    path, hf = checkpoint
    result = qcompile.compile(path, AWQ_PIPELINE, tmp_path / "awq")
    assert result.path == tmp_path / "awq" and [r.name for r in result.reports] == ["awq"]

    model = qcompile.load(tmp_path / "awq")
    assert model.manifest is not None and model.tokenizer is not None
    ids = model.tokenizer("def f(x):", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model.model(ids)
        float_logits = hf(ids).logits
    assert logits.shape == (1, ids.shape[1], hf.config.vocab_size)
    rel = float((logits - float_logits).norm() / float_logits.norm())
    assert 0 < rel < 0.5, rel  # quantized: close to the float model, not equal to it

    ppl = qcompile.evaluate(model, windows=1)["ppl"]
    assert math.isfinite(ppl) and ppl > 1
    assert qcompile.evaluate(tmp_path / "awq", windows=1)["ppl"] == pytest.approx(ppl)

    text = qcompile.generate(model, "def f(x):", max_tokens=8)
    want = model.model.generate(ids, 8, model.model.config.eos_token_ids)
    assert text == model.tokenizer.decode(want[0, ids.shape[1]:], skip_special_tokens=True)

    summary = qcompile.inspect(tmp_path / "awq")
    assert summary["formats"]["int4"] == 14  # 2 layers × 7 linears; lm_head stays float

    bundle = qcompile.lower(tmp_path / "awq", "onnx", tmp_path / "onnx", max_len=64).path
    assert (bundle / "bundle.json").is_file()


def test_compile_takes_a_loaded_model_and_a_toml_file(checkpoint, tmp_path):
    path, _ = checkpoint
    toml = tmp_path / "float.toml"
    toml.write_text("[model]\ndtype = \"float32\"\n")
    loaded = qcompile.load(path)
    result = qcompile.compile(loaded, toml, tmp_path / "float")
    assert result.loaded is loaded and result.reports == []
    assert qcompile.inspect(tmp_path / "float")["formats"] == {"float32": 16}  # 14 linears, lm_head, embeddings


def test_evaluate_against_a_reference(checkpoint, tmp_path):
    """The KL-divergence statistics, a reference file saved and reused: the CLI's --json dict."""
    path, _ = checkpoint
    model = qcompile.load(path)
    live = qcompile.evaluate(model, windows=1, reference=path, save_reference=tmp_path / "ref.kld")
    assert live["kld_mean"] == 0 and live["same_top"] == 1 and live["tokens"] == 511
    from_file = qcompile.evaluate(path, windows=1, reference=tmp_path / "ref.kld")
    assert from_file["reference"] == str(tmp_path / "ref.kld") and from_file["ppl_base"] == pytest.approx(live["ppl"])
    assert set(from_file) == set(live) >= {"ppl", "ppl_base", "kld_mean", "kld_99", "rms_dp", "same_top", "corpus"}
    with pytest.raises(ConfigError, match="--plot needs a reference"):
        qcompile.evaluate(model, windows=1, plot=tmp_path / "kld.png")


def test_errors_are_qcompile_errors(tmp_path):
    with pytest.raises(QCompileError, match="no such file"):
        qcompile.load(tmp_path / "missing")
    with pytest.raises(ConfigError, match="unknown pass"):
        qcompile.compile(tmp_path / "missing", {"passes": [{"name": "awk"}]}, tmp_path / "out")
    with pytest.raises(ConfigError, match="unknown target 'tensorrt'"):
        qcompile.lower(tmp_path, "tensorrt", tmp_path / "out")


def test_generate_takes_the_engines_sampling_parameters(checkpoint):
    """``qcompile.generate`` runs the token loop every runtime shares: the engine's sampling
    parameters, as keywords or one ``SamplingParams``, with its stop strings and one-line errors."""
    from serving.types import RequestError, SamplingParams

    model = qcompile.load(checkpoint[0])
    greedy = qcompile.generate(model, "def f(x):", max_tokens=12, ignore_eos=True)
    stop = greedy[3:5]
    assert qcompile.generate(model, "def f(x):", params=SamplingParams(max_tokens=12, ignore_eos=True, stop=stop)) \
        == greedy[:greedy.index(stop)]
    sampled = qcompile.generate(model, "def f(x):", max_tokens=12, temperature=0.9, top_k=20, seed=5, ignore_eos=True)
    assert sampled == qcompile.generate(model, "def f(x):", max_tokens=12, temperature=0.9, top_k=20, seed=5,
                                        ignore_eos=True)
    with pytest.raises(RequestError, match="top_p must be in"):
        qcompile.generate(model, "x", top_p=0.0)
    with pytest.raises(RequestError, match="unknown sampling setting 'temprature'"):
        qcompile.generate(model, "x", temprature=0.5)
