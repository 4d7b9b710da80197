"""``qcompile lower --target gguf``: the file's tensors are the artifact's weights (read back by the
``gguf`` package's dequantization through qcompile's GGUF reader), and every refusal."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from gguf_helpers_llama import compile_awq, save_checkpoint

import backends  # noqa: F401  (registers the gguf target)
from backends.gguf.export import file_notes
from compiler.deploy.lowering import lower
from compiler.errors import ArtifactError, ConfigError, PipelineValidationError
from compiler.formats.qlinear import quantized_modules
from compiler.io.artifact import load_artifact
from compiler.io.gguf import read_gguf
from compiler.model.config import ModelConfig
from compiler.pipeline import Pipeline, PipelineConfig

ROOT = Path(__file__).resolve().parents[3]
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("gguf-export"), "llama")


def stored_types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def assert_file_holds_the_artifact(artifact, path, exact: bool = True) -> float:
    """Every quantized layer of the file dequantizes to the artifact's weights (bit for bit, or the
    largest relative difference when not ``exact``)."""
    _, tensors = read_gguf(path, torch.float32)
    worst = 0.0
    for name, module in quantized_modules(load_artifact(artifact).model).items():
        ours, theirs = module.dequantized_weight().float(), tensors[f"{name}.weight"]
        if exact:
            assert torch.equal(ours, theirs), f"{name}: max diff {float((ours - theirs).abs().max())}"
        worst = max(worst, float((ours - theirs).norm() / ours.norm()))
    return worst


@pytest.mark.parametrize("fmt,types", [("gguf:q4_0", {"Q4_0"}), ("gguf:q4_1", {"Q4_1"}),
                                       ("gguf:q4_k", {"Q4_K"}), ("gguf:q4_k_m", {"Q4_K", "Q6_K"})])
def test_awq_gguf_formats_are_written_code_for_code(llama, tmp_path, fmt, types):
    artifact = compile_awq(llama, tmp_path / "art", format=fmt)
    out = lower(artifact, "gguf", tmp_path / "m.gguf").path
    assert {t for name, t in stored_types(out).items() if name.split(".")[-2] in LINEARS} == types
    assert_file_holds_the_artifact(artifact, out)


def test_q4_k_m_upgrades_within_llama_cpps_budget(llama, tmp_path):
    artifact = compile_awq(llama, tmp_path / "art", format="gguf:q4_k_m")
    report = load_artifact(artifact).manifest.reports[0]
    wide = [r for r in report["layers"] if r["format"] == "gguf:q6_k"]
    assert wide and all("measured sensitive" in r["reason"] for r in wide)
    assert any("q4_k_m:" in note for note in report["notes"])
    # the plan listed the Q6_K entry each of them got before any work (the target is checked for it)
    loaded = load_artifact(artifact)
    plan = Pipeline(PipelineConfig.from_dict({"passes": [{"name": "awq", "format": "gguf:q4_k_m"}]})).validate(
        loaded.model.config)
    assert all(plan.alternatives[r["module"]] == loaded.manifest.modules[r["module"]] for r in wide)


@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_artifacts_become_q4_0_exactly_and_q4_1_within_ms_rounding(llama, tmp_path, zero_point, group_size):
    artifact = compile_awq(llama, tmp_path / "art", group_size=group_size, zero_point=zero_point)
    out = lower(artifact, "gguf", tmp_path / "m.gguf").path
    assert {t for n, t in stored_types(out).items() if n.split(".")[-2] in LINEARS} == {"Q4_1" if zero_point else "Q4_0"}
    worst = assert_file_holds_the_artifact(artifact, out, exact=not zero_point)
    notes = file_notes(out)
    if zero_point:  # m = -s*z in float16: a few 1e-4 of the weights at most, and said per layer
        assert 0 < worst < 1e-3 and sum("Q4_1's m" in n for n in notes) == len(quantized_modules(load_artifact(artifact).model))
    else:
        assert not any("Q4_1" in n for n in notes)


@pytest.mark.parametrize("float_type,stored", [("auto", "F32"), ("f16", "F16"), ("bf16", "BF16")])
def test_float_tensors_in_the_type_asked_norms_in_f32(llama, tmp_path, float_type, stored):
    artifact = compile_awq(llama, tmp_path / "art", format="gguf:q4_0")
    types = stored_types(lower(artifact, "gguf", tmp_path / "m.gguf", {"float_type": float_type}).path)
    assert types["token_embd.weight"] == stored and types["output.weight"] == stored
    assert types["output_norm.weight"] == "F32" and types["blk.0.attn_norm.weight"] == "F32"


def test_embedding_in_q8_0_when_asked_and_said(llama, tmp_path):
    artifact = compile_awq(llama, tmp_path / "art", format="gguf:q4_0")
    out = lower(artifact, "gguf", tmp_path / "m.gguf", {"embedding_type": "q8_0"}).path
    assert stored_types(out)["token_embd.weight"] == "Q8_0"
    assert any(n.startswith("embed_tokens: Q8_0 by round-to-nearest") for n in file_notes(out))
    _, tensors = read_gguf(out, torch.float32)
    ours = load_artifact(artifact).model.embed_tokens.weight.detach().float()
    assert 0 < float((tensors["embed_tokens.weight"] - ours).norm() / ours.norm()) < 0.01


def test_refusals_before_any_work(llama, tmp_path):
    fp8 = compile_fp8(llama, tmp_path)
    with pytest.raises(ConfigError, match="fp8 weights: no GGUF block type"):
        lower(fp8, "gguf", tmp_path / "fp8.gguf")
    assert not (tmp_path / "fp8.gguf").exists()
    artifact = compile_awq(llama, tmp_path / "art", format="gguf:q4_0")
    with pytest.raises(ConfigError, match="float_type must be"):
        lower(artifact, "gguf", tmp_path / "x.gguf", {"float_type": "f8"})
    lower(artifact, "gguf", tmp_path / "ok.gguf")
    with pytest.raises(ArtifactError, match="already exists"):
        lower(artifact, "gguf", tmp_path / "ok.gguf")


def test_what_a_gguf_file_cannot_hold_is_named():
    from backends.gguf.export import check_config, check_module

    padded = {"format": "int4", "group_size": 64, "in_features": 576, "padded_in_features": 640}
    assert "zero-padded" in check_module("layers.0.mlp.up_proj", padded)
    assert check_module("x", {"format": "int4", "group_size": 64, "in_features": 576, "padded_in_features": 576}) is None
    assert "zero-padded" in check_module("x", {"format": "gguf", "block_type": "q4_k", "in_features": 576,
                                               "padded_in_features": 768})
    base = dict(vocab_size=64, dim=64, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=96)
    assert "no model qcompile writes" in check_config(ModelConfig(architecture="DeepseekV3ForCausalLM", **{
        **base, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "q_lora_rank": 0,
        "kv_lora_rank": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 24}))
    assert "sliding window" in check_config(ModelConfig(architecture="MistralForCausalLM", sliding_window=16,
                                                        max_seq_len=128, **base))
    gemma = dict(base, architecture="Gemma3ForCausalLM", head_dim=32, query_pre_attn_scalar=32.0, sliding_window=8)
    assert "pattern" in check_config(ModelConfig(layer_types=["full_attention"] * 2, **gemma))
    assert check_config(ModelConfig(layer_types=["sliding_attention"] * 2, **gemma)) is None


def compile_fp8(checkpoint, tmp_path):
    import passes  # noqa: F401
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    config = {"calibration": {"samples": 4, "seq_len": 64}, "passes": [{"name": "fp8", "max_layer_error": 10.0}]}
    return compile_model(checkpoint, PipelineConfig.from_dict(config), tmp_path / "fp8").path


def test_a_pipeline_for_gguf_refuses_what_it_cannot_hold(llama, tmp_path):
    with pytest.raises(PipelineValidationError, match="fp8 weights"):
        import passes  # noqa: F401
        from compiler.pipeline import PipelineConfig
        from compiler.pipeline.compile import compile_model

        config = {"calibration": {"samples": 4, "seq_len": 64}, "passes": [{"name": "fp8"}], "target": {"name": "gguf"}}
        compile_model(llama, PipelineConfig.from_dict(config), tmp_path / "x")


def test_awq_gguf_format_refuses_rows_no_block_divides(tmp_path):
    from compiler.pipeline.selection import meta_model
    from passes.awq_plan import AWQOptions, plan_layers

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, dim=80, n_layers=1, n_heads=2, n_kv_heads=1,
                         intermediate_size=96)
    with pytest.raises(ConfigError, match="GGUF blocks of 32 do not divide in_features of .*80"):
        plan_layers(meta_model(config), AWQOptions(format="gguf:q4_0"))
    wide = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, dim=96, n_layers=1, n_heads=2, n_kv_heads=1,
                       intermediate_size=256)
    plans, _ = plan_layers(meta_model(wide), AWQOptions(format="gguf:q4_k"))
    assert plans["layers.0.mlp.down_proj"].block_type == "q4_k"  # 256 wide
    assert plans["layers.0.mlp.up_proj"].block_type == "q5_0" and "fallback" in plans["layers.0.mlp.up_proj"].reason


def test_cli_lower_prints_the_notes_and_refuses_in_one_line(llama, tmp_path):
    artifact = compile_awq(llama, tmp_path / "art", group_size=32, zero_point=True)
    run = subprocess.run([sys.executable, "-m", "qcompile", "lower", str(artifact), "--target", "gguf", "-o",
                          str(tmp_path / "m.gguf")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "note: layers.0.self_attn.q_proj: Q4_1's m" in run.stdout and "tokenizer" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "qcompile", "lower", str(artifact), "--target", "gguf", "-o",
                          str(tmp_path / "m.gguf")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode != 0 and "already exists" in bad.stderr and "Traceback" not in bad.stderr


def test_q4_k_m_compiles_whole_not_streamed(llama, tmp_path):
    """Its Q6_K layers are chosen over the whole model after the last block: a streamed compile
    (blocks written as they are done) would lose them, so it is refused, saying why."""
    import passes  # noqa: F401
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    config = PipelineConfig.from_dict({"calibration": {"samples": 4, "seq_len": 64},
                                       "passes": [{"name": "awq", "format": "gguf:q4_k_m"}]})
    with pytest.raises(ConfigError, match="pass awq needs the whole model in memory"):
        compile_model(llama, config, tmp_path / "art", streaming="on")
