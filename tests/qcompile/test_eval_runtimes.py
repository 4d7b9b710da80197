"""``qcompile eval ARTIFACT --reference REF --runtimes ...`` (``qcompile/eval_runtimes.py``) on a tiny
INT4 artifact: the engine rows are ``compare_to_reference``'s, the lowerings' rows near them, a
runtime that cannot run is a row with its reason, an unknown one an error before any work. llama.cpp
is tested where it is built (as tests/backends/gguf/), vLLM with the integration tests (one 64-token
window: its start takes a minute or more)."""
import json
import subprocess
import sys

import pytest
import torch
from conftest import make_byte_tokenizer, make_hf_model

from backends.gguf.llama_cpp import missing_reason
from calib.kl_divergence import TopLogProbs
from compiler.io.load import load_checkpoint
from compiler.pipeline.evaluate import compare_to_reference, reference_windows, score_windows, scored_logits
from qcompile import eval_runtimes
from qcompile.eval_runtimes import TRITON_REASON, compare_runtimes

# head_dim 32 and linears of 64 and 96 inputs: what vLLM's CPU attention and INT4 kernel take; AWQ
# group 32: a MatMulNBits block size and a GGUF block (Q4_1).
SHAPE = dict(num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
AWQ = {"name": "awq", "group_size": 32, "alpha_grid": 4, "clip_grid": 4, "module_candidates": 0, "search_tokens": 512}
TOP_K = 100  # what the vLLM test asks for
# The goal of issue 45: every runtime's mean KLD within 10% of the in-process one (1-2% measured here).
WITHIN = 0.10


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(reference checkpoint, INT4 artifact compiled from it), as paths."""
    import backends  # noqa: F401
    import passes  # noqa: F401
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    root = tmp_path_factory.mktemp("eval-runtimes")
    tokenizer = make_byte_tokenizer()
    make_hf_model("llama", vocab_size=len(tokenizer), **SHAPE).save_pretrained(root / "float")
    tokenizer.save_pretrained(root / "float")
    config = PipelineConfig.from_dict({"calibration": {"samples": 4, "seq_len": 64}, "passes": [AWQ]})
    return root / "float", compile_model(root / "float", config, root / "awq").path


def rows_of(result: dict) -> dict[str, dict]:
    return {row["runtime"]: row for row in result["runtimes"]}


def test_engine_rows_are_compare_to_reference(models):
    reference, artifact = models
    candidate, ref = load_checkpoint(artifact), load_checkpoint(reference)
    result = compare_runtimes(candidate, ["engine"], ref, windows=2, eval_len=128)
    rows = rows_of(result)
    assert list(rows) == ["engine w4a16", "engine w4a8"]  # INT4 layers: both ways they compute
    alone = compare_to_reference(candidate, ref, windows=2, eval_len=128)  # the model as loaded: W4A16
    statistics = [key for key in alone if key not in result]  # the table's, not the corpus, windows, ...
    assert all(rows["engine w4a16"][key] == alone[key] for key in statistics), (rows["engine w4a16"], alone)
    w4a8 = rows["engine w4a8"]
    assert w4a8["kl_over"] == "full vocabulary" and "int8 activations" in w4a8["runs"]
    assert w4a8["kld_mean"] != alone["kld_mean"]  # its own numerics, not the W4A16 row again
    assert abs(w4a8["kld_mean"] / alone["kld_mean"] - 1) < WITHIN
    assert result["windows"] == 2 and result["reference"] == str(reference) and w4a8["tokens"] == 2 * 127


def test_onnx_row_is_near_the_engines(models, tmp_path):
    reference, artifact = models
    result = compare_runtimes(load_checkpoint(artifact), ["engine", "onnx"], load_checkpoint(reference), windows=1,
                              eval_len=128, runtime_dir=tmp_path / "lowered")
    rows = rows_of(result)
    onnx, engine = rows["onnx"], rows["engine w4a16"]
    assert "unavailable" not in onnx, onnx
    assert onnx["kl_over"] == "full vocabulary" and "MatMulNBits" in onnx["runs"]
    assert onnx["tokens"] == engine["tokens"] == 127
    assert abs(onnx["kld_mean"] / engine["kld_mean"] - 1) < WITHIN, (onnx, engine)
    assert abs(onnx["ln_ppl_ratio"] - engine["ln_ppl_ratio"]) < 0.01
    assert (tmp_path / "lowered" / "onnx" / "bundle.json").exists()  # --runtime-dir keeps what was lowered


def test_a_runtime_that_cannot_run_is_a_row_with_its_reason(models):
    reference, artifact = models
    # A checkpoint, not an artifact: the engine runs it, nothing lowers it.
    result = compare_runtimes(load_checkpoint(reference), ["engine", "onnx", "triton"], load_checkpoint(reference),
                              windows=1, eval_len=64)
    rows = rows_of(result)
    assert rows["engine"]["kld_mean"] == 0 and rows["engine"]["same_top"] == 1
    assert "is not a qcompile artifact" in rows["onnx"]["unavailable"]
    assert rows["triton"]["unavailable"] == TRITON_REASON
    assert all("\n" not in row.get("unavailable", "") for row in result["runtimes"])


def qcompile(*args):
    return subprocess.run([sys.executable, "-m", "qcompile", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def test_cli_prints_one_row_per_runtime(models, tmp_path):
    reference, artifact = models
    r = qcompile("eval", artifact, "--reference", reference, "--windows", "1", "--runtimes", "engine,triton",
                 "--output-json", tmp_path / "rows.json")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("│")]
    assert [line.split("│")[1].strip() for line in lines] == ["engine w4a16", "engine w4a8", "triton"]
    assert "full vocabulary" in lines[0] and "±" in lines[0] and f"not run: {TRITON_REASON}" in lines[2]
    saved = json.loads((tmp_path / "rows.json").read_text())
    assert [row["runtime"] for row in saved["runtimes"]] == ["engine w4a16", "engine w4a8", "triton"]
    assert saved["runtimes"][0]["tokens"] == 511 and saved["runtimes"][2]["unavailable"] == TRITON_REASON


@pytest.mark.parametrize("args, message", [
    (["--runtimes", "engine,onxx"], "--runtimes: unknown runtime 'onxx'; did you mean 'onnx'?"),
    (["--runtimes", "engine", "--plot", "kld.png"], "--plot draws one candidate's histogram"),
])
def test_cli_refuses_before_any_work(tmp_path, args, message):
    r = qcompile("eval", tmp_path / "missing", "--reference", tmp_path / "missing-too", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr  # not the missing model: nothing was loaded
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_runtimes_need_a_reference(tmp_path):
    r = qcompile("eval", tmp_path / "missing", "--runtimes", "engine")
    assert r.returncode == 2 and "--runtimes compares each runtime with a reference" in r.stderr, r.stderr


@pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
def test_llama_cpp_row(models):
    reference, artifact = models
    rows = rows_of(compare_runtimes(load_checkpoint(artifact), ["engine", "gguf"], load_checkpoint(reference),
                                    windows=1, eval_len=64))
    gguf, engine = rows["gguf"], rows["engine w4a16"]
    assert "unavailable" not in gguf, gguf
    assert gguf["kl_over"] == "full vocabulary" and gguf["tokens"] == 63
    assert abs(gguf["kld_mean"] / engine["kld_mean"] - 1) < WITHIN, (gguf, engine)


@pytest.mark.integration
def test_vllm_row(models, tmp_path, monkeypatch):
    """vLLM's prompt log-probabilities (its top-k and the target): the KLD over them is near the engine's
    own logits reduced to their top-k the same way, and no more than the engine's full KLD."""
    from backends.vllm.runtime import vllm_host, vllm_python

    monkeypatch.setattr(eval_runtimes, "VLLM_TOP_K", TOP_K)  # fewer than the 320 tokens: a top-k, not the whole vocabulary
    python = vllm_python()  # not installed: a failure, as in tests/backends/vllm/
    reference, artifact = models
    candidate, ref = load_checkpoint(artifact), load_checkpoint(reference)
    rows = rows_of(compare_runtimes(candidate, ["engine", "vllm"], ref, windows=1, eval_len=64, runtime_dir=tmp_path))
    vllm, engine = rows["vllm"], rows["engine w4a16"]
    if not vllm_host(python).w4a16:
        assert "no W4A16 kernel" in vllm["unavailable"]
        return
    assert "unavailable" not in vllm, (vllm, (tmp_path / "vllm.log").read_text(errors="replace")[-3000:])
    assert vllm["kl_over"] == f"top-{TOP_K} + target, the rest as one token (a lower bound)" and vllm["tokens"] == 63

    def engine_top_k(batch: torch.Tensor) -> TopLogProbs:
        return TopLogProbs.from_logits(scored_logits(candidate, batch), batch[:, 1:].reshape(-1), TOP_K)

    windowed = reference_windows(candidate, ref, windows=1, eval_len=64)
    same_way = score_windows(windowed, {"engine top-k": engine_top_k})["engine top-k"].result()
    assert same_way["kld_mean"] <= engine["kld_mean"]
    # vLLM runs the INT4 layers in float16 (its CPU kernels take no float32), the engine in float32
    assert abs(vllm["kld_mean"] / same_way["kld_mean"] - 1) < WITHIN, (vllm, same_way)
    assert vllm["kld_mean"] <= engine["kld_mean"] * (1 + WITHIN)
    assert abs(vllm["ln_ppl_ratio"] - engine["ln_ppl_ratio"]) < 0.01


def test_python_api(models, tmp_path):
    import qcompile
    from compiler.errors import ConfigError

    reference, artifact = models
    result = qcompile.evaluate(str(artifact), reference=str(reference), windows=1, runtimes=["engine", "triton"])
    assert [row["runtime"] for row in result["runtimes"]] == ["engine w4a16", "engine w4a8", "triton"]
    assert result["runtimes"][0]["tokens"] == 511 and result["corpus"] == "pydoc"
    with pytest.raises(ConfigError, match="unknown runtime 'vlm'; did you mean 'vllm'"):
        qcompile.evaluate(tmp_path / "missing", reference=reference, runtimes=["vlm"])  # before the model is read
