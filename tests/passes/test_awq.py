"""The AWQ pass on tiny random checkpoints: folding, packing, group-size policies, target checks,
max_layer_error retries and the artifact round trip."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import passes  # noqa: F401  (registers awq)
from compiler.deploy.targets import TARGETS, Target, register_target
from compiler.errors import ConfigError, PipelineValidationError
from compiler.formats.int4 import Int4Linear, pack_int4, pack_zeros, unpack_int4, unpack_zeros
from compiler.io.artifact import load_artifact
from compiler.io.load import load_checkpoint
from compiler.io.summary import artifact_summary
from compiler.model.config import ModelConfig
from compiler.pipeline import Pipeline, PipelineConfig
from compiler.pipeline.calibration import TokenSampler
from compiler.pipeline.compile import compile_model
from compiler.pipeline.selection import meta_model
from compiler.quant.int4 import (
    choose_qparams,
    dequantize,
    fake_quantize,
    pad_columns,
    quantize,
)
from passes.awq import BlockQuantizer, capture
from passes.awq_mappings import expand_columns, fold_scales, layer_groups
from passes.awq_plan import AWQOptions, plan_layers
from passes.awq_search import candidate_scales, fast_fake_quantize, weight_mean

ROOT = Path(__file__).resolve().parents[2]
# GQA (4 query heads on 2 kv heads) so v -> o folding goes through the head mapping.
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
SMOLLM2_LIKE = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, dim=576, n_layers=2, n_heads=9,
                           n_kv_heads=3, intermediate_size=1536)


def text_ids(tokenizer, rows: int, length: int) -> torch.Tensor:
    """[rows, length] token ids of pydoc text from the end of the corpus (calibration reads its start)."""
    from calib import load_corpus_text

    ids = tokenizer(load_corpus_text("pydoc")[-20_000:])["input_ids"][: rows * length]
    return torch.tensor(ids).view(rows, length)


def pipeline_config(calibration=None, target=None, **awq) -> PipelineConfig:
    d = {"calibration": calibration or {"samples": 4, "seq_len": 64}, "passes": [{"name": "awq", **awq}]}
    if target:
        d["target"] = {"name": target}
    return PipelineConfig.from_dict(d)


@pytest.mark.parametrize("zero_point", [True, False])
@pytest.mark.parametrize("k,g", [(128, 32), (576, 64), (1536, 128), (200, 64)])
def test_quantize_pack_unpack_round_trip_is_exact(k, g, zero_point):
    w = pad_columns(torch.randn(24, k), g)
    scale, zero = choose_qparams(w, g, zero_point)
    q = quantize(w, scale, zero, g)
    assert torch.equal(unpack_int4(pack_int4(q, g)), q)
    assert torch.equal(unpack_zeros(pack_zeros(zero), zero.shape[1]), zero)
    assert torch.equal(dequantize(q, scale, zero, g), fake_quantize(w, g, zero_point))
    # The search's faster fake quantization is the same function.
    clip = torch.rand(24, w.shape[1] // g) * 0.5 + 0.5
    assert torch.equal(fast_fake_quantize(w, g, zero_point, clip), fake_quantize(w, g, zero_point, clip))


def _capture_all(model, tokenizer, opts: AWQOptions):
    """Per block: (block prefix, input stats, input sample for module scoring), propagating float
    inputs as the pass does."""
    from calib import CalibrationConfig
    from compiler.pipeline import PassContext

    ctx = PassContext(tokenizer=tokenizer, calibration=CalibrationConfig(samples=4, seq_len=64))
    windows = ctx.calibration_windows()
    positions = torch.arange(windows.shape[1]).expand(opts.batch_size, -1)
    with torch.no_grad():
        x = model.embed_tokens(windows)
        cos, sin = model.rope(positions, x.dtype)
        out = []
        for i, block in enumerate(model.layers):
            sample = (x[:2], cos[:2], sin[:2], positions[:2])
            x, stats = capture(block, layer_groups(model.config, i), x, cos, sin, positions,
                               TokenSampler(opts.search_tokens, windows.numel(), torch.Generator().manual_seed(0)))
            out.append((f"layers.{i}.", stats, sample))
    return out


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {"tie_word_embeddings": True})])
def test_scale_folding_leaves_float_model_unchanged(tiny_checkpoint_with_tokenizer, arch, overrides):
    path, _ = tiny_checkpoint_with_tokenizer(arch, **TINY, **overrides)
    loaded = load_checkpoint(path)
    model = loaded.model
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(ids)
        opts = AWQOptions(group_size=32)
        plans, _ = plan_layers(model, opts)
        # 1) the searched scales (module scoring included: it must restore every weight it tries),
        #    folded by the pass's own code
        alphas = []
        for i, (prefix, stats, sample) in enumerate(_capture_all(model, loaded.tokenizer, opts)):
            worker = BlockQuantizer(model, prefix, plans, opts, None, layer_groups(model.config, i))
            worker.inspected = worker._inspect_modules(sample)
            assert set(worker.inspected) == {"self_attn", "mlp"}
            rows, _ = worker.search_and_fold(stats)
            alphas += [r.metrics["alpha"] for r in rows.values()]
        # 2) large random scales on every group (incl. GQA v -> o), so folding is surely exercised
        gen = torch.Generator().manual_seed(5)
        for i, block in enumerate(model.layers):
            for group in layer_groups(model.config, i):
                expand = expand_columns(block, group, model.config)
                c = block.get_submodule(group.prev).weight.shape[0]
                s = torch.rand(c, generator=gen) * 4 + 0.25
                fold_scales(block, group, s, s if expand is None else s[expand])
        after = model(ids)
    rel = float((after - before).norm() / before.norm())
    print(f"folding: relative logit change {rel:.2e}; searched alphas {sorted(set(alphas))}")
    assert rel < 1e-5


def test_group_size_policies_resolve_per_layer():
    fallback, _ = plan_layers(meta_model(SMOLLM2_LIKE), AWQOptions(group_size=128))
    assert fallback["layers.0.self_attn.q_proj"].group_size == 64
    assert "128 does not divide in_features 576" in fallback["layers.0.self_attn.q_proj"].reason
    assert fallback["layers.1.mlp.down_proj"].group_size == 128  # 1536 = 12 * 128
    assert "lm_head" not in fallback
    pad, _ = plan_layers(meta_model(SMOLLM2_LIKE), AWQOptions(group_size=128, group_size_policy="pad"))
    assert pad["layers.0.mlp.up_proj"].group_size == 128
    assert pad["layers.0.mlp.up_proj"].format(True)["padded_in_features"] == 640
    g256, _ = plan_layers(meta_model(SMOLLM2_LIKE), AWQOptions(group_size=256))
    assert g256["layers.0.self_attn.o_proj"].group_size == 64  # 576 = 9 * 64, 128 and 256 do not divide
    assert g256["layers.0.mlp.down_proj"].group_size == 256


def test_group_size_policy_error_names_every_offending_layer():
    with pytest.raises(ConfigError) as e:
        plan_layers(meta_model(SMOLLM2_LIKE), AWQOptions(group_size=128, group_size_policy="error"))
    msg = str(e.value)
    for suffix in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert f"layers.{{0-1}}.{suffix}" in msg
    assert "in_features 576" in msg and "down_proj" not in msg and "group_size_policy" in msg
    # fallback with no allowed divisor points to pad
    odd = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, dim=80, n_layers=1, n_heads=4, n_kv_heads=4,
                      intermediate_size=64)
    with pytest.raises(ConfigError, match=r"in_features 80.*group_size_policy = \"pad\""):
        plan_layers(meta_model(odd), AWQOptions(group_size=64))


def test_modules_to_not_convert_reads_as_it_does_for_every_pass():
    plans, excluded = plan_layers(meta_model(SMOLLM2_LIKE), AWQOptions(modules_to_not_convert=["lm_head", "self_attn"]))
    assert sorted(plans) == sorted(f"layers.{i}.mlp.{m}" for i in (0, 1) for m in ("gate_proj", "up_proj", "down_proj"))
    assert excluded["layers.1.self_attn.o_proj"] == "self_attn" and excluded["lm_head"] == "lm_head"
    plans, _ = plan_layers(meta_model(SMOLLM2_LIKE), AWQOptions(modules_to_not_convert=["layers.*.mlp.down_proj", "layers.0"]))
    assert sorted(plans) == sorted([f"layers.1.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                              "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")] + ["lm_head"])
    with pytest.raises(PipelineValidationError, match=r"passes\[0\] \(awq\): modules_to_not_convert pattern "
                       r"'mlp.down' matches no module \(did you mean 'mlp.down_proj'\? names look like "
                       r"'layers.0.self_attn.q_proj'\); fix or remove it") as e:
        Pipeline(pipeline_config(modules_to_not_convert=["lm_head", "mlp.down"])).validate(SMOLLM2_LIKE)
    assert "\n" not in str(e.value)


def test_pipeline_validation_uses_resolved_group_sizes():
    with pytest.raises(PipelineValidationError, match="layers.{0-1}.self_attn.q_proj"):
        Pipeline(pipeline_config(group_size=128, group_size_policy="error")).validate(SMOLLM2_LIKE)
    register_target(Target("test-no-g64", "rejects group size 64 (test double)",
                           lambda module, fmt: "group size 64 unsupported" if fmt.get("group_size") == 64 else None,
                           lower=None))  # validation only
    try:
        # g128 resolves to 64 on the 576-wide layers: the target must reject it before any work.
        with pytest.raises(PipelineValidationError, match=r"test-no-g64.*q_proj \(and \d+ more layers\): group size 64 unsupported"):
            Pipeline(pipeline_config(group_size=128, target="test-no-g64")).validate(SMOLLM2_LIKE)
        formats = Pipeline(pipeline_config(group_size=128, group_size_policy="pad", target="test-no-g64")).validate(SMOLLM2_LIKE).formats
        assert {f["group_size"] for f in formats.values()} == {128}
    finally:
        TARGETS.pop("test-no-g64")


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="group_size must be one of"):
        Pipeline(pipeline_config(group_size=100))
    with pytest.raises(ConfigError, match="group_size_policy"):
        Pipeline(pipeline_config(group_size_policy="shrink"))
    with pytest.raises(ConfigError, match="weight_rounding"):
        Pipeline(pipeline_config(weight_rounding="stochastic"))
    with pytest.raises(ConfigError, match="gptq_damp"):
        Pipeline(pipeline_config(gptq_damp=0.0))


@pytest.mark.parametrize("rounding", ["nearest", "gptq"])
def test_awq_artifact_reloads_with_same_logits(tiny_checkpoint_with_tokenizer, tmp_path, rounding):
    path, _ = tiny_checkpoint_with_tokenizer("llama", **TINY)
    result = compile_model(path, pipeline_config(group_size=128, weight_rounding=rounding), tmp_path / "awq")
    report = result.reports[0]
    layers = {r.module: r for r in report.layers}
    assert (layers["lm_head"].format, layers["lm_head"].reason) == ("float", "modules_to_not_convert 'lm_head'")
    q = layers["layers.0.self_attn.q_proj"]
    assert q.format == "int4" and q.reason == "requested"
    assert {"group_size", "alpha", "clip_ratio", "rel_error_rtn", "output_error"} <= set(q.metrics)
    rows = load_artifact(tmp_path / "awq").manifest.reports[0]["layers"]  # serialised as they are
    assert rows == [dataclasses.asdict(r) for r in report.layers]
    assert report.metrics["layers_quantized"] == 14
    assert report.metrics["mean_output_error"] < report.metrics["mean_rel_error_rtn"]
    reloaded = load_artifact(tmp_path / "awq")
    ids = torch.randint(0, result.loaded.model.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected, got = result.loaded.model(ids), reloaded.model(ids)
    assert torch.isfinite(got).all() and torch.equal(expected, got)
    # size on disk: packed codes + fp32 scales + packed zeros (a lone block still takes a zero byte)
    summary = artifact_summary(tmp_path / "awq")
    int4 = [layer for layer in summary["layers"] if layer["format"] == "int4"]
    assert len(int4) == 14
    for layer in int4:
        n_blocks = layer["padded_in_features"] // 128
        expected = 4 + 8 * (4 * n_blocks + (n_blocks + 1) // 2) / layer["in_features"]
        assert layer["bits_per_weight"] == pytest.approx(expected, abs=1e-3)
        assert 4.25 <= layer["bits_per_weight"] <= 4.32


HEAD_CALIBRATION = {"samples": 32, "seq_len": 64}  # 2048 tokens: GPTQ's fit of a 128-wide head generalises


@pytest.mark.parametrize("streaming", ["off", "on"])
@pytest.mark.parametrize("tie", [False, True])
def test_lm_head_let_through_is_quantized_last_and_reloads(tiny_checkpoint_with_tokenizer, tmp_path, tie, streaming):
    path, _ = tiny_checkpoint_with_tokenizer("llama", tie_word_embeddings=tie, **TINY)
    float_model = load_checkpoint(path).model
    body_only = compile_model(path, pipeline_config(HEAD_CALIBRATION, group_size=32), tmp_path / "body").loaded.model
    result = compile_model(path, pipeline_config(HEAD_CALIBRATION, group_size=32, modules_to_not_convert=[]), tmp_path / "awq",
                           streaming=streaming)
    head = result.reports[0].layers[-1]
    assert (head.module, head.format, head.metrics["scale_group"]) == ("lm_head", "int4", "norm → lm_head")
    assert head.metrics["output_error"] < head.metrics["rel_error_rtn"]
    reloaded = load_artifact(tmp_path / "awq")
    model = reloaded.model
    assert reloaded.manifest.modules["lm_head"]["format"] == "int4"
    assert torch.equal(model.embed_tokens.weight, float_model.embed_tokens.weight)  # the lookup keeps float rows
    ids = text_ids(reloaded.tokenizer, 2, 64)
    with torch.no_grad():
        want, got = body_only(ids), model(ids)
        body_only.lm_head = Int4Linear.from_float(body_only.lm_head, 32)  # the same head by round-to-nearest
        rtn = body_only(ids)
    err, err_rtn = (((y - want).norm() / want.norm()).item() for y in (got, rtn))  # what the head's quantization adds
    assert torch.isfinite(got).all() and 0 < err < err_rtn, f"relative logit error {err:.3f}, RTN {err_rtn:.3f}"


def test_max_layer_error_retries_smaller_groups_within_target(tiny_checkpoint_with_tokenizer, tmp_path):
    path, _ = tiny_checkpoint_with_tokenizer("llama", **TINY)
    register_target(Target("test-no-g32", "rejects group size 32 (test double)",
                           lambda module, fmt: "no g32" if fmt.get("group_size") == 32 else None, lower=None))
    try:
        result = compile_model(path, pipeline_config(group_size=128, max_layer_error=1e-6, target="test-no-g32"),
                               tmp_path / "retry")
    finally:
        TARGETS.pop("test-no-g32")
    rows = [r for r in result.reports[0].layers if r.format == "int4"]
    assert all(r.metrics["group_size"] == 64 for r in rows)  # 128 too lossy, 64 tried, 32 refused by the target
    assert all("max_layer_error" in r.reason and "no smaller group size left" in r.reason for r in rows)
    manifest = load_artifact(tmp_path / "retry").manifest
    assert {m["group_size"] for m in manifest.modules.values()} == {64}


def test_cli_prints_one_line_error_for_error_policy(tiny_checkpoint_with_tokenizer, tmp_path):
    path, _ = tiny_checkpoint_with_tokenizer("llama", hidden_size=96, intermediate_size=128, num_attention_heads=4,
                                             num_key_value_heads=2)
    cfg = tmp_path / "p.toml"
    cfg.write_text('[[passes]]\nname = "awq"\ngroup_size = 64\ngroup_size_policy = "error"\n')
    proc = subprocess.run([sys.executable, "-c", "from qcompile.cli import main; main()", "compile", str(path),
                           "-c", str(cfg), "-o", str(tmp_path / "out")], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "400"}, timeout=300)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "in_features 96" in lines[0] and "self_attn.q_proj" in lines[0]
    assert not (tmp_path / "out").exists()


def test_example_pipeline_files_validate():
    from qcompile.cli.example import VARIANTS, example_pipeline

    files = [v.pipeline for v in VARIANTS if v.pipeline.startswith("awq")]
    assert files
    for f in files:
        formats = Pipeline(PipelineConfig.from_toml(example_pipeline(f))).validate(SMOLLM2_LIKE).formats
        assert formats and all(fmt["format"] == "int4" for fmt in formats.values())


def test_duo_scaling_candidates_follow_autoawq():
    """s = mean|x|^α / (w_mean^(1-α) + 1e-4), w_mean = mean over rows of |w| / its group's max."""
    w = torch.tensor([[1.0, -2.0, 4.0, 0.5], [2.0, 2.0, -1.0, 1.0]])
    w_mean = weight_mean(w, group_size=2)
    assert torch.allclose(w_mean, torch.tensor([(0.5 + 1.0) / 2, (1.0 + 1.0) / 2, (1.0 + 1.0) / 2, (0.125 + 1.0) / 2]), atol=1e-5)
    x_mean = torch.tensor([1.0, 4.0, 0.5, 2.0])
    s = candidate_scales(x_mean, 0.5, w_mean)
    raw = x_mean.sqrt() / (w_mean.sqrt() + 1e-4)
    assert torch.allclose(s, raw / (raw.max() * raw.min()).sqrt())
    assert torch.allclose(candidate_scales(x_mean, 0.0), torch.ones(4))  # α = 0 without duo: plain RTN
