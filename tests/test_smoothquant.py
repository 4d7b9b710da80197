"""SmoothQuant's channel smoothing: the float model is unchanged, outliers move into the weights,
and the fp8 pass's static activations get more accurate with it."""
from __future__ import annotations

import pytest
import torch

import passes  # noqa: F401  (registers the fp8 pass)
from compiler.checkpoint import load_checkpoint
from compiler.compile import compile_loaded
from compiler.errors import ConfigError
from compiler.pipeline import Pipeline, PipelineConfig
from compiler.qlinear import linear_modules
from passes.smoothquant import smooth_model, smoothing_scales
from tests.distill_helpers import tiny_model

CALIB = {"corpus": "pydoc", "samples": 4, "seq_len": 64, "seed": 0}


def ids(n=2, t=16, vocab=64):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(3))


def input_amax(model, tokens) -> dict[str, torch.Tensor]:
    amax = {}
    hooks = [m.register_forward_pre_hook(lambda _m, a, n=n: amax.__setitem__(n, a[0].abs().flatten(0, -2).amax(0)))
             for n, m in linear_modules(model).items() if n != "lm_head"]
    model(tokens)
    for h in hooks:
        h.remove()
    return amax


def test_scales_are_the_papers_formula():
    s = smoothing_scales(torch.tensor([4.0, 1.0, 0.0]), torch.tensor([1.0, 4.0, 2.0]), alpha=0.5)
    # sqrt(4)/sqrt(1), sqrt(1)/sqrt(4); a channel never active keeps 1
    assert torch.allclose(s, torch.tensor([2.0, 0.5, 1.0]))


@torch.no_grad()
def test_smoothing_keeps_the_float_model_and_flattens_the_activations():
    model = tiny_model().double()
    model.layers[0].input_layernorm.weight[5] = 40.0  # an outlier channel into q/k/v
    model.layers[1].post_attention_layernorm.weight[7] = 30.0  # and into gate/up
    before_logits, before = model(ids()), input_amax(model, ids())
    done = smooth_model(model, before, alpha=0.5)
    # every group of both layers, o_proj's through GQA (4 heads read 2 kv heads of v_proj)
    assert len(done) == 8 and "layers.0.self_attn.v_proj" in done
    assert torch.allclose(model(ids()), before_logits, rtol=1e-10, atol=1e-10)
    after = input_amax(model, ids())
    for name in ("layers.0.self_attn.q_proj", "layers.1.mlp.gate_proj", "layers.0.self_attn.o_proj", "layers.1.mlp.down_proj"):
        spread = lambda a: float(a.max() / a.median())  # noqa: E731
        print(f"{name}: channel abs-max / median {spread(before[name]):.1f} -> {spread(after[name]):.1f}")
        assert spread(after[name]) < 0.5 * spread(before[name])


@torch.no_grad()
def test_groups_with_a_consumer_left_out_are_not_touched():
    model = tiny_model().double()
    amax = input_amax(model, ids())
    del amax["layers.0.self_attn.k_proj"]  # e.g. in modules_to_not_convert: q/k/v share the norm, so none move
    norm = model.layers[0].input_layernorm.weight.clone()
    done = smooth_model(model, amax, alpha=0.5)
    assert "layers.0.input_layernorm" not in done and len(done) == 7
    assert torch.equal(model.layers[0].input_layernorm.weight, norm)


@pytest.fixture
def tiny(tiny_checkpoint_with_tokenizer):
    path, _ = tiny_checkpoint_with_tokenizer("llama")

    def load():
        loaded = load_checkpoint(path)
        with torch.no_grad():  # an outlier channel, as trained LLMs have, feeding q/k/v and gate/up
            for layer in loaded.model.layers:
                layer.input_layernorm.weight[3] = 60.0
                layer.post_attention_layernorm.weight[11] = 60.0
        return loaded
    return load


def mean_error(report, suffixes=("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")) -> float:
    errors = [r["rel_error"] for r in report.layers if r["module"].endswith(suffixes)]
    return sum(errors) / len(errors)


def test_pass_smoothing_lowers_static_activation_errors(tiny, tmp_path):
    options = {"name": "fp8", "activation_scheme": "static", "max_layer_error": 10.0, "weight_rounding": "nearest"}
    plain = compile_loaded(tiny(), PipelineConfig.from_dict({"calibration": CALIB, "passes": [options]}), tmp_path / "a")
    smoothed_config = PipelineConfig.from_dict({"calibration": CALIB, "passes": [options | {"smoothquant_alpha": 0.5}]})
    smoothed = compile_loaded(tiny(), smoothed_config, tmp_path / "b")
    before, after = mean_error(plain.reports[0]), mean_error(smoothed.reports[0])
    print(f"mean relative error of the norm-fed layers: {before:.4f} without smoothing, {after:.4f} with")
    assert smoothed.reports[0].metrics["smoothed_groups"] == 8
    assert after < 0.85 * before


@pytest.mark.parametrize("options, message", [
    ({"smoothquant_alpha": 1.5}, "smoothquant_alpha must be in"),
    ({"smoothquant_alpha": 0.5, "activation_scheme": "none"}, "only helps quantized activations"),
])
def test_bad_smoothing_options_are_one_line_config_errors(options, message):
    with pytest.raises(ConfigError, match=message) as e:
        Pipeline(PipelineConfig.from_dict({"passes": [{"name": "fp8", **options}]}))
    assert "\n" not in str(e.value)
