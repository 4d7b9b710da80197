"""Calibrating mixture-of-experts layers: per-expert statistics, token counts in the report, and
the starved-expert policy of AWQ and FP8 (``passes/moe_calibration.py``).

The starved model is a tiny Qwen3-MoE (8 experts, top 2) whose router rows are three ± pairs
(experts 0-5: ±10·v₁, ±10·v₂, ±10·v₃) and two zero rows (experts 6, 7): every token has at
least three positive logits, so its top two never include the zero-logit experts 6 and 7. They
receive no calibration token at all — what a real router does to rare experts on a narrow
calibration set, made certain.
"""
from __future__ import annotations

import pytest
import torch
from arch_helpers import make_arch_model

import passes  # noqa: F401  (registers the passes)
from calib import CalibrationConfig
from compiler.errors import PipelineValidationError
from compiler.formats.fp8 import Fp8Linear
from compiler.formats.int4 import Int4Linear
from compiler.io.load import load_checkpoint
from compiler.model.moe import every_token_to
from compiler.pipeline import PassContext, Pipeline, PipelineConfig
from compiler.pipeline.calibration import InputRequest, TokenSampler, collect_block
from compiler.pipeline.compile import compile_loaded
from compiler.pipeline.selection import meta_model
from passes.awq_plan import AWQOptions, plan_layers

CALIB = {"corpus": "pydoc", "samples": 4, "seq_len": 64, "seed": 0}
STARVED = (6, 7)
TOP_K, TOKENS = 2, 4 * 64


def save(path, tokenizer, starve: bool):
    hf = make_arch_model("qwen3-moe", vocab_size=len(tokenizer))
    if starve:
        with torch.no_grad():
            g = torch.Generator().manual_seed(11)
            for layer in hf.model.layers:
                router = layer.mlp.gate.weight  # [8, dim]
                v = torch.nn.functional.normalize(torch.randn(3, router.shape[1], generator=g), dim=-1) * 10
                router.copy_(torch.cat([v[0:1], -v[0:1], v[1:2], -v[1:2], v[2:3], -v[2:3], torch.zeros(2, router.shape[1])]))
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def starved_src(tmp_path_factory, byte_tokenizer):
    return save(tmp_path_factory.mktemp("starved") / "hf", byte_tokenizer, starve=True)


def compile_with(src, tmp, name, **options):
    config = PipelineConfig.from_dict({"calibration": CALIB, "passes": [{"name": name, **options}]})
    return compile_loaded(load_checkpoint(src), config, tmp)


@torch.no_grad()
def test_expert_statistics_are_of_the_tokens_routed_to_it(tmp_path, byte_tokenizer):
    model = load_checkpoint(save(tmp_path / "m", byte_tokenizer, starve=False)).model
    block, moe = model.layers[0], model.layers[0].mlp
    x = torch.randn(4, 16, model.config.dim, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, -1)
    cos, sin = model.rope(positions, x.dtype)
    seen = []
    hook = moe.register_forward_pre_hook(lambda _m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    experts = range(model.config.num_experts)
    requests = {f"mlp.experts.{e}.{n}": InputRequest(mean_abs=True, gram="sampled") for e in experts
                for n in ("gate_proj", "down_proj")}
    # keep = every token: each expert's sampled Gram is then over all its tokens, comparable by hand
    _, stats = collect_block(block, x, cos, sin, positions, requests, TokenSampler(64, 64, torch.Generator()))
    hook.remove()
    flat = torch.cat(seen)  # [64, dim], the MoE's input
    _, ids = moe.route(flat)
    assert sum(stats.inputs[f"mlp.experts.{e}.gate_proj"].tokens for e in experts) == TOP_K * 64
    for e in experts:
        mine = flat[(ids == e).any(-1)]
        st = stats.inputs[f"mlp.experts.{e}.gate_proj"]
        assert st.tokens == len(mine)
        if len(mine):
            assert torch.allclose(st.mean_abs, mine.abs().mean(0), atol=1e-6)
            assert torch.allclose(st.hessian, mine.T @ mine / len(mine), atol=1e-5)
            hidden = moe.experts[e].act(moe.experts[e].gate_proj(mine)) * moe.experts[e].up_proj(mine)
            assert torch.allclose(stats.inputs[f"mlp.experts.{e}.down_proj"].mean_abs, hidden.abs().mean(0), atol=1e-6)
    # a sampled Gram over part of the tokens draws each expert's own sample, at the same rate
    _, part = collect_block(block, x, cos, sin, positions, requests, TokenSampler(16, 64, torch.Generator()))
    assert all(torch.isfinite(s.hessian).all() for s in part.inputs.values())


@torch.no_grad()
def test_every_token_to_feeds_chosen_experts_every_token_and_keeps_the_output(tmp_path, byte_tokenizer):
    model = load_checkpoint(save(tmp_path / "m", byte_tokenizer, starve=True)).model
    moe = model.layers[1].mlp
    x = torch.randn(2, 12, model.config.dim, generator=torch.Generator().manual_seed(1))
    rows = []
    hook = moe.experts[6].gate_proj.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0]))
    routed = moe(x)
    assert rows == []  # starved: the router sends expert 6 nothing
    with every_token_to(model, {"layers.1.mlp": {6}}):
        everything = moe(x)
    hook.remove()
    assert rows == [24] and moe.every_token == frozenset()
    assert torch.allclose(everything, routed, atol=1e-6)


def rows_of(result) -> dict:
    return {r.module: r for r in result.reports[0].layers}


def test_awq_calibrates_starved_experts_on_every_token(starved_src, tmp_path):
    result = compile_with(starved_src, tmp_path / "a", "awq", group_size=32, min_expert_tokens=1)
    rows, n_layers = rows_of(result), 3
    assert result.reports[0].metrics["experts_starved"] == len(STARVED) * n_layers
    for i in range(n_layers):
        tokens = [rows[f"layers.{i}.mlp.experts.{e}.gate_proj"].metrics["expert_tokens"] for e in range(8)]
        assert sum(tokens) == TOP_K * TOKENS and [tokens[e] for e in STARVED] == [0, 0]
        for e in range(8):
            for n in ("gate_proj", "up_proj", "down_proj"):
                row = rows[f"layers.{i}.mlp.experts.{e}.{n}"]
                assert row.format == "int4" and row.metrics["output_error"] is not None
                if e in STARVED:  # its statistics: every token of the layer, so its error is measured on them
                    assert row.metrics["calibration_tokens"] == TOKENS and row.metrics["rel_error_rtn"] > 0
                    assert row.reason == ("expert routed 0 of 256 calibration tokens (< min_expert_tokens 1): calibrated "
                                          "on all 256 tokens of its layer (starved_experts = 'all_tokens')")
        assert "alpha" in rows[f"layers.{i}.mlp.experts.6.down_proj"].metrics  # its up → down scales searched
        assert rows[f"layers.{i}.mlp.gate"].format == "float"


@torch.no_grad()
def test_awq_rounds_starved_experts_to_nearest_under_rtn(starved_src, tmp_path):
    result = compile_with(starved_src, tmp_path / "a", "awq", group_size=32, starved_experts="rtn", min_expert_tokens=1)
    rows, model = rows_of(result), result.loaded.model
    float_model = load_checkpoint(starved_src, with_tokenizer=False).model
    for i in range(3):
        row = rows[f"layers.{i}.mlp.experts.6.down_proj"]
        assert "round-to-nearest" in row.reason and "starved_experts = 'rtn'" in row.reason
        assert "alpha" not in row.metrics and row.metrics["output_error"] is None  # nothing to measure it on
        # no scale of its own, no clip, no GPTQ: exactly RTN of the checkpoint's weight
        want = Int4Linear.from_float(float_model.get_submodule(f"layers.{i}.mlp.experts.6.down_proj"), 32)
        assert torch.equal(model.get_submodule(f"layers.{i}.mlp.experts.6.down_proj").dequantized_weight(),
                           want.dequantized_weight())
        assert "alpha" in rows[f"layers.{i}.mlp.experts.0.down_proj"].metrics  # the routed ones are searched


@torch.no_grad()
def test_fp8_static_scales_are_per_expert_and_starved_experts_see_every_token(starved_src, tmp_path, byte_tokenizer):
    result = compile_with(starved_src, tmp_path / "a", "fp8", activation_scheme="static", input_shift=False,
                          max_layer_error=10.0, min_expert_tokens=1)
    rows = rows_of(result)
    float_model = load_checkpoint(starved_src, with_tokenizer=False).model
    windows = PassContext(byte_tokenizer, CalibrationConfig(**CALIB)).calibration_windows()
    seen = []
    hook = float_model.layers[1].mlp.register_forward_pre_hook(lambda _m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    float_model(windows)
    hook.remove()
    flat = torch.cat(seen)
    _, ids = float_model.layers[1].mlp.route(flat)
    for e in range(8):
        mine = flat if e in STARVED else flat[(ids == e).any(-1)]
        row = rows[f"layers.1.mlp.experts.{e}.gate_proj"]
        assert row.metrics["input_scale"] == pytest.approx(float(mine.abs().max()) / 448, rel=1e-6), e
        assert row.format == "fp8" and row.metrics["expert_tokens"] == (0 if e in STARVED else len(mine))
        assert row.metrics.get("calibration_tokens") == (TOKENS if e in STARVED else None)
    assert "calibrated on all 256 tokens" in rows["layers.1.mlp.experts.7.down_proj"].reason
    assert result.reports[0].metrics["experts_starved"] == 6
    assert isinstance(result.loaded.model.layers[1].mlp.experts[7].down_proj, Fp8Linear)


def test_fp8_keeps_starved_experts_in_float_under_float(starved_src, tmp_path):
    result = compile_with(starved_src, tmp_path / "a", "fp8", starved_experts="float", max_layer_error=10.0,
                          min_expert_tokens=1)
    rows, model = rows_of(result), result.loaded.model
    for i in range(3):
        for e in range(8):
            row = rows[f"layers.{i}.mlp.experts.{e}.up_proj"]
            if e in STARVED:
                assert row.format == "float" and row.reason.endswith("kept in float (starved_experts = 'float')")
                assert type(model.get_submodule(f"layers.{i}.mlp.experts.{e}.up_proj")) is torch.nn.Linear
            else:
                assert row.format == "fp8" and row.metrics["expert_tokens"] > 0


@pytest.mark.parametrize("name, options, match", [
    ("awq", {"min_expert_tokens": 0}, "min_expert_tokens must be >= 1"),
    ("awq", {"starved_experts": "float"}, "starved_experts"),
    ("fp8", {"starved_experts": "rtn"}, "starved_experts"),
    ("fp8", {"min_expert_tokens": -1}, "min_expert_tokens must be >= 1"),
])
def test_bad_expert_options_are_one_line_errors(name, options, match):
    from compiler.errors import ConfigError

    with pytest.raises(ConfigError, match=match) as e:
        Pipeline(PipelineConfig.from_dict({"passes": [{"name": name, **options}]}))
    assert "\n" not in str(e.value)


def test_group_size_checks_cover_the_expert_widths(tmp_path, byte_tokenizer):
    """Experts 24 wide (down_proj's inputs): g32 does not divide them; the error names every expert's down_proj."""
    config = load_checkpoint(save(tmp_path / "m", byte_tokenizer, starve=False), with_tokenizer=False).model.config
    config.moe_intermediate_size = 24
    with pytest.raises(PipelineValidationError, match=r"layers.\{0-2\}.mlp.experts.7.down_proj \(in_features 24\)"):
        Pipeline(PipelineConfig.from_dict({"passes": [{"name": "awq", "group_size": 32,
                                                        "group_size_policy": "error"}]})).validate(config)
    plans, _ = plan_layers(meta_model(config), AWQOptions(group_size=32, group_size_policy="pad"))
    assert plans["layers.2.mlp.experts.5.down_proj"].reason == "pad: in_features 24 zero-padded to 32"
    assert plans["layers.0.mlp.experts.0.gate_proj"].reason == "requested"
