"""The fp8 pass on tiny random checkpoints: artifact round trip, fallback, KV cache, validation."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import passes  # noqa: F401  (registers the fp8 pass)
from compiler.errors import ConfigError, PipelineValidationError
from compiler.formats.fp8 import Fp8Linear
from compiler.formats.kv_quant import Fp8KVQuant
from compiler.io.artifact import load_artifact, read_manifest
from compiler.io.load import load_checkpoint
from compiler.io.summary import artifact_summary
from compiler.model.kv_cache import ContiguousKVCache
from compiler.pipeline import (
    PASSES,
    Pass,
    PassContext,
    PassPlan,
    Pipeline,
    PipelineConfig,
    register_pass,
)
from compiler.pipeline.compile import compile_loaded
from passes.fp8 import Fp8Options

CALIB = {"corpus": "pydoc", "samples": 4, "seq_len": 64, "seed": 0}


def pipeline(**fp8_options) -> PipelineConfig:
    return PipelineConfig.from_dict({"calibration": CALIB, "passes": [{"name": "fp8", **fp8_options}]})


@pytest.fixture
def tiny(tiny_checkpoint_with_tokenizer):
    path, _ = tiny_checkpoint_with_tokenizer("llama")
    return lambda: load_checkpoint(path)


def ids(n=2, t=24, vocab=300):
    return torch.randint(3, vocab, (n, t), generator=torch.Generator().manual_seed(7))


# Bounds: the logits are of random ids, unlike the calibration text; GPTQ's fit to calibration
# inputs (the default rounding) does not carry over to them on a random tiny model (0.22 vs 0.18).
@pytest.mark.parametrize("options, bound", [
    ({}, 0.3),  # W8A8, per-channel weights, dynamic per-token activations
    ({"activation_scheme": "static", "static_calibration": "percentile", "granularity": "per_tensor"}, 0.3),
    # E5M2 keeps 2 mantissa bits (E4M3: 3); the tiny random model amplifies rounding
    ({"weight_dtype": "float8_e5m2", "activation_dtype": "float8_e5m2", "kv_cache_dtype": "float8_e5m2",
      "kv_cache_granularity": "per_tensor"}, 0.6),
])
@torch.no_grad()
def test_artifact_round_trip_gives_same_logits(tiny, tmp_path, options, bound):
    float_logits = tiny().model(ids())
    loaded = tiny()
    result = compile_loaded(loaded, pipeline(max_layer_error=10.0, **options), tmp_path / "a")
    in_memory = loaded.model(ids())
    reloaded = load_artifact(result.path)
    assert torch.equal(reloaded.model(ids()), in_memory)
    assert torch.isfinite(in_memory).all()
    rel = float((in_memory - float_logits).norm() / float_logits.norm())
    print(f"{options}: relative logit error {rel:.4f}")
    assert 0 < rel < bound  # quantized (not identical), but close
    mods = reloaded.manifest.modules
    assert len(mods) == 14 and "lm_head" not in mods  # 2 layers × 7 Linears; lm_head kept by default
    assert all(m["format"] == "fp8" for m in mods.values())
    assert isinstance(reloaded.model.layers[0].mlp.down_proj, Fp8Linear)


def test_inspect_shows_fp8_layers_at_a_quarter_of_float32(tiny, tmp_path):
    result = compile_loaded(tiny(), pipeline(max_layer_error=None, input_shift=False), tmp_path / "a")
    layers = {r["module"]: r for r in artifact_summary(result.path)["layers"]}
    q = layers["layers.0.mlp.down_proj"]
    assert q["format"] == "fp8" and 8.0 <= q["bits_per_weight"] < 8.5  # 8-bit codes + per-channel scales
    assert layers["lm_head"]["bits_per_weight"] == 32
    # the default input_shift adds a float32 shift per input and a float32 bias per output
    shifted = compile_loaded(tiny(), pipeline(max_layer_error=None), tmp_path / "b")
    q = {r["module"]: r for r in artifact_summary(shifted.path)["layers"]}["layers.0.mlp.down_proj"]
    n, k = 64, 96
    assert q["bits_per_weight"] == pytest.approx((8 * n * k + 32 * n + 32 * n + 32 * k) / (n * k), abs=0.01)


def test_fallback_keeps_layers_above_max_layer_error(tiny, tmp_path):
    loaded = tiny()
    result = compile_loaded(loaded, pipeline(max_layer_error=1e-6), tmp_path / "a")
    (report,) = result.reports
    assert report.metrics["converted"] == 0 and report.metrics["fallback"] == 14
    excluded, *rows = report.layers
    assert (excluded.module, excluded.format, excluded.reason) == ("lm_head", "float", "modules_to_not_convert 'lm_head'")
    assert len(rows) == 14
    assert all(r.format == "float" and r.metrics["output_error"] > 1e-6 and "> max_layer_error" in r.reason for r in rows)
    assert any("max_layer_error" in n for n in report.notes)
    assert report.notes[-1] == "not converted (modules_to_not_convert): lm_head"
    assert read_manifest(result.path).modules == {}
    assert type(loaded.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def test_measuring_layer_errors_keeps_no_float_copy_of_the_weights(tiny, tmp_path):
    """The error check runs each layer once through its float32 weight copy; the compiled model
    must not keep those copies (4 bytes a weight: more than the float model it replaces)."""
    loaded = tiny()
    compile_loaded(loaded, pipeline(max_layer_error=10.0), tmp_path / "a")
    converted = [m for m in loaded.model.modules() if isinstance(m, Fp8Linear)]
    assert len(converted) == 14
    assert all(m._float_weight.value is None for m in converted)


def test_fallback_decision_uses_measured_error(tiny, tmp_path):
    """A threshold between the smallest and largest layer error splits the layers accordingly."""
    loaded = tiny()
    rows = compile_loaded(tiny(), pipeline(max_layer_error=10.0), tmp_path / "a").reports[0].layers
    errors = {r.module: r.metrics["output_error"] for r in rows if "output_error" in r.metrics}
    threshold = sorted(errors.values())[len(errors) // 2]
    report = compile_loaded(loaded, pipeline(max_layer_error=threshold), tmp_path / "b").reports[0]
    for r in report.layers[1:]:  # [0]: lm_head, excluded
        assert r.format == ("float" if errors[r.module] > threshold else "fp8")
    assert 0 < report.metrics["fallback"] < 14
    rows = read_manifest(tmp_path / "b").reports[0]["layers"]  # the same rows, serialised
    assert [r["module"] for r in rows] == [r.module for r in report.layers]
    assert set(rows[1]) == {"module", "format", "reason", "metrics"}


@torch.no_grad()
def test_fp8_kv_cache_alone(tiny, tmp_path):
    loaded = tiny()
    result = compile_loaded(loaded, pipeline(convert_linears=False, kv_cache_dtype="float8_e4m3fn"), tmp_path / "a")
    manifest = read_manifest(result.path)
    assert manifest.modules == {}
    kv = manifest.kv_cache
    assert kv["dtype"] == "float8_e4m3fn" and kv["granularity"] == "per_head"
    assert len(kv["k_scale"]) == 2 and all(len(s) == 2 and min(s) > 0 for s in kv["k_scale"] + kv["v_scale"])
    model = load_artifact(result.path).model
    assert isinstance(model.layers[1].self_attn.kv_quant, Fp8KVQuant)
    # the same rounding with a cache object (incremental decoding) as without one
    x = ids(1, 12)
    full = model(x)
    c = model.config
    cache = ContiguousKVCache(c.n_layers, 1, 12, c.n_kv_heads, c.head_dim)
    steps = [model(x[:, :6], torch.arange(6)[None], cache)]
    steps += [model(x[:, i:i + 1], torch.tensor([[i]]), cache) for i in range(6, 12)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)
    float_model = tiny().model
    assert not torch.equal(float_model(x), full)  # the KV rounding is in effect


def test_planned_formats_respect_patterns(tiny):
    config = tiny().model.config
    p = Pipeline(pipeline(modules_to_not_convert=["lm_head", "layers.0"]))
    formats = p.validate(config).formats
    assert sorted(formats) == sorted(f"layers.1.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                                 "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    assert formats["layers.1.mlp.up_proj"] == {"format": "fp8", "in_features": 64, "out_features": 96,
                                               "weight_dtype": "float8_e4m3fn", "granularity": "per_channel",
                                               "activation_scheme": "dynamic", "activation_dtype": "float8_e4m3fn",
                                               "input_shift": True}


@dataclasses.dataclass
class _ClaimOptions:
    modules: list[str] = dataclasses.field(default_factory=list)


class ClaimingPassDouble(Pass):
    """A test double for another weight pass (e.g. awq): claims the modules it is given."""

    name = "test_claiming_double"
    Options = _ClaimOptions

    def plan(self, model):
        return PassPlan({m: {"format": "double"} for m in self.options.modules})


def test_two_passes_cannot_claim_one_layer(tiny):
    if ClaimingPassDouble.name not in PASSES:
        register_pass(ClaimingPassDouble)
    config = tiny().model.config
    both = {"calibration": CALIB, "passes": [{"name": "test_claiming_double", "modules": ["layers.0.mlp.down_proj"]},
                                               {"name": "fp8"}]}
    with pytest.raises(PipelineValidationError, match="layers.0.mlp.down_proj is already claimed"):
        Pipeline(PipelineConfig.from_dict(both)).validate(config)
    both["passes"][1]["modules_to_not_convert"] = ["lm_head", "layers.0.mlp.down_proj"]
    formats = Pipeline(PipelineConfig.from_dict(both)).validate(config).formats
    assert formats["layers.0.mlp.down_proj"] == {"format": "double"}


@pytest.mark.parametrize("options, message", [
    ({"weight_dtype": "float8_e4m3"}, "weight_dtype"),
    ({"granularity": "per_group"}, "granularity"),
    ({"percentile": 0}, "percentile"),
    ({"max_layer_error": -1.0}, "max_layer_error"),
    ({"weight_rounding": "stochastic"}, "weight_rounding"),
    ({"gptq_damp": 0}, "gptq_damp"),
    ({"convert_linears": False}, "converts nothing"),
    ({"kv_cache_granularity": "per_token"}, "kv_cache_granularity"),
    ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
    ({"max_layer_eror": 0.1}, "did you mean 'max_layer_error'"),
    ({"activation_group_size": 40}, "multiple of 16"),
    ({"activation_group_size": 32, "activation_scheme": "static"}, "needs activation_scheme"),
    ({"outlier_channels": -1}, "outlier_channels must be >= 0"),
])
def test_bad_options_are_one_line_config_errors(options, message):
    with pytest.raises(ConfigError, match=message) as e:
        Pipeline(pipeline(**options))
    assert "\n" not in str(e.value)


def test_activation_group_must_divide_every_layer(tiny):
    # the tiny model's Linears read 64 (hidden) or 96 (intermediate) features: 64 does not divide 96
    with pytest.raises(PipelineValidationError, match="64 does not divide layers.0.mlp.down_proj's 96 input "
                                                      "features; .*for 96: 16, 32, 48, 96"):
        Pipeline(pipeline(activation_group_size=64)).validate(tiny().model.config)


@torch.no_grad()
def test_activation_groups_round_trip_through_the_artifact(tiny, tmp_path):
    float_logits = tiny().model(ids())
    loaded = tiny()
    result = compile_loaded(loaded, pipeline(max_layer_error=10.0, activation_group_size=32), tmp_path / "a")
    reloaded = load_artifact(result.path)
    assert torch.equal(reloaded.model(ids()), loaded.model(ids()))
    assert 0 < float((reloaded.model(ids()) - float_logits).norm() / float_logits.norm()) < 0.3
    assert all(m["activation_group_size"] == 32 for m in reloaded.manifest.modules.values())


def test_outlier_channels_must_be_below_every_layers_inputs(tiny):
    with pytest.raises(PipelineValidationError, match="outlier_channels 64 is not below layers.0.self_attn.q_proj's 64"):
        Pipeline(pipeline(outlier_channels=64)).validate(tiny().model.config)


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_outlier_channels_are_the_largest_shifted_variances_and_round_trip(tiny, tmp_path, scheme):
    """Each layer keeps the r channels whose calibration inputs vary most about their mean; the
    reloaded artifact gives the in-memory logits, closer to float than without them. (The pass
    runs outside no_grad, as from the command line, where the weights require grad.)"""
    float_model = tiny().model.requires_grad_(False)
    float_logits = float_model(ids())
    errors = {}
    for r in (0, 8):
        loaded = tiny()
        assert loaded.model.layers[0].mlp.up_proj.weight.requires_grad
        config = pipeline(max_layer_error=10.0, activation_scheme=scheme, outlier_channels=r)
        result = compile_loaded(loaded, config, tmp_path / f"r{r}")
        reloaded = load_artifact(result.path)
        with torch.no_grad():
            assert torch.equal(reloaded.model(ids()), loaded.model(ids()))
            errors[r] = float((reloaded.model(ids()) - float_logits).norm() / float_logits.norm())
    print(f"{scheme}: relative logit error without outlier channels {errors[0]:.4f}, with 8: {errors[8]:.4f}")
    assert 0 < errors[8] < errors[0]
    assert all(m["outlier_channels"] == 8 for m in reloaded.manifest.modules.values())
    seen = []
    handle = float_model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, 96)))
    float_model(PassContext(tokenizer=loaded.tokenizer, calibration=config.calibration).calibration_windows())
    handle.remove()
    down = reloaded.model.layers[1].mlp.down_proj
    assert torch.equal(down.outlier_index, torch.cat(seen).var(0).topk(8).indices.sort().values)


def test_pattern_matching_nothing_is_a_validation_error(tiny):
    with pytest.raises(PipelineValidationError, match=r"passes\[0\] \(fp8\): modules_to_not_convert pattern "
                       r"'layer.0' matches no module \(did you mean 'layers.0'\? names look like "
                       r"'layers.0.self_attn.q_proj'\)") as e:
        Pipeline(pipeline(modules_to_not_convert=["layer.0"])).validate(tiny().model.config)
    assert "\n" not in str(e.value)


def test_self_attn_keeps_every_attention_linear_in_float(tiny):
    formats = Pipeline(pipeline(modules_to_not_convert=["lm_head", "self_attn"])).validate(tiny().model.config).formats
    assert sorted(formats) == sorted(f"layers.{i}.mlp.{m}" for i in (0, 1) for m in ("gate_proj", "up_proj", "down_proj"))


def test_options_defaults_keep_lm_head_and_embeddings():
    assert Fp8Options().modules_to_not_convert == ["lm_head", "embed_tokens"]


def test_example_pipeline_validates(tiny):
    from qcompile.cli.example import VARIANTS, example_pipeline

    assert "fp8.toml" in [v.pipeline for v in VARIANTS]
    formats = Pipeline(PipelineConfig.from_toml(example_pipeline("fp8.toml"))).validate(tiny().model.config).formats
    assert len(formats) == 14 and all(f["format"] == "fp8" for f in formats.values())


def test_cli_reports_bad_fp8_option_in_one_line(tmp_path, tiny_checkpoint):
    import subprocess
    import sys

    path, _ = tiny_checkpoint("llama")
    bad = tmp_path / "bad.toml"
    bad.write_text('[[passes]]\nname = "fp8"\nweight_dtype = "float8_e4m3"\n')
    proc = subprocess.run([sys.executable, "-c", "from qcompile.cli import main; main()", "compile", str(path),
                           "-c", str(bad), "-o", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "weight_dtype" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_gptq_rounding_lowers_layer_errors(tiny, tmp_path):
    """GPTQ (the default weight_rounding) compensates rounding on calibration inputs: lower error per layer
    on held calibration rows (``output_error`` is measured on the calibration inputs' sample)."""
    nearest = compile_loaded(tiny(), pipeline(max_layer_error=10.0, activation_scheme="none", weight_rounding="nearest"),
                             tmp_path / "a").reports[0]
    gptq = compile_loaded(tiny(), pipeline(max_layer_error=10.0, activation_scheme="none"), tmp_path / "b").reports[0]
    before, after = nearest.metrics["mean_output_error"], gptq.metrics["mean_output_error"]
    print(f"mean relative layer error: nearest {before:.4f}, gptq {after:.4f}")
    assert after < 0.8 * before


@torch.no_grad()
def test_input_shift_subtracts_calibration_means_and_round_trips(tiny, tmp_path):
    """Each converted layer stores its inputs' calibration mean and W·mean as its bias (the tiny
    Llama has none of its own); the reloaded artifact gives the in-memory logits, close to float."""
    float_model = tiny().model
    float_logits = float_model(ids())
    loaded = tiny()
    config = pipeline(max_layer_error=10.0, input_shift=True)
    result = compile_loaded(loaded, config, tmp_path / "a")
    reloaded = load_artifact(result.path)
    assert torch.equal(reloaded.model(ids()), loaded.model(ids()))
    assert 0 < float((reloaded.model(ids()) - float_logits).norm() / float_logits.norm()) < 0.3
    assert all(m["input_shift"] for m in reloaded.manifest.modules.values())
    # the shift is the mean of what the float layer reads on the calibration windows
    seen = []
    float_down = float_model.layers[1].mlp.down_proj
    handle = float_down.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, 96)))
    float_model(PassContext(tokenizer=loaded.tokenizer, calibration=config.calibration).calibration_windows())
    handle.remove()
    down = reloaded.model.layers[1].mlp.down_proj
    assert torch.allclose(down.input_shift, torch.cat(seen).mean(0), atol=1e-5)
    assert torch.allclose(down.bias, float_down.weight @ down.input_shift, atol=1e-5)
