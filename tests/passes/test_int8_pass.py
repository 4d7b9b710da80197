"""The int8 pass (SmoothQuant + GPTQ, ``passes/int8.py``) on tiny checkpoints: artifact round trip per
scheme, SmoothQuant's fold and what it buys on an outlier channel, the strength chosen on the
validation split, the static range, fusion in the engine, and its refusals."""
from __future__ import annotations

import pytest
import torch

import passes  # noqa: F401  (registers the int8 pass)
from compiler.errors import ConfigError, PipelineValidationError
from compiler.formats.int8 import Int8Linear
from compiler.io.artifact import load_artifact, read_manifest
from compiler.io.load import load_checkpoint
from compiler.model.fusion import fuse_projections
from compiler.pipeline import PassContext, PipelineConfig
from compiler.pipeline.calibration import InputRequest
from compiler.pipeline.compile import compile_loaded
from compiler.pipeline.selection import meta_model
from passes.int8 import Int8Options, Int8Pass, float_outputs, smooth, static_qparams

CALIB = {"corpus": "pydoc", "samples": 4, "seq_len": 64, "seed": 0}


def pipeline(**options) -> PipelineConfig:
    return PipelineConfig.from_dict({"calibration": CALIB, "passes": [{"name": "int8", **options}]})


@pytest.fixture
def tiny(tiny_checkpoint_with_tokenizer):
    path, _ = tiny_checkpoint_with_tokenizer("llama")
    return lambda: load_checkpoint(path)


def ids(n=2, t=24, vocab=300):
    return torch.randint(3, vocab, (n, t), generator=torch.Generator().manual_seed(7))


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


# Measured on the tiny random model (logits of random ids, unlike the calibration text GPTQ fits): 0.03-0.07.
@pytest.mark.parametrize("options, bound", [
    ({}, 0.1),
    ({"activation_symmetric": False}, 0.1),
    ({"activation_scheme": "static", "smoothing_strength": 0.5}, 0.1),
    ({"activation_scheme": "none"}, 0.06),
    ({"smoothing": "all", "smoothing_strength": 0.5, "weight_rounding": "nearest"}, 0.1),
])
@torch.no_grad()
def test_artifact_round_trip_gives_the_same_logits(tiny, tmp_path, options, bound):
    float_logits = tiny().model(ids())
    loaded = tiny()
    result = compile_loaded(loaded, pipeline(**options), tmp_path / "a")
    in_memory = loaded.model(ids())
    reloaded = load_artifact(result.path)
    assert torch.equal(reloaded.model(ids()), in_memory)
    err = rel(in_memory, float_logits)
    print(options, f"logits {err:.3f} from float")
    assert err < bound
    manifest = read_manifest(result.path)
    report = manifest.reports[-1]
    converted = [r for r in report["layers"] if r["format"] == "int8"]
    assert len(converted) == 14 and all(r["metrics"]["output_error"] < 0.1 for r in converted)
    assert {m["format"] for m in manifest.modules.values()} == {"int8"}
    assert all(isinstance(reloaded.model.get_submodule(n), Int8Linear) for n in manifest.modules)
    if options.get("activation_scheme") == "static":
        assert all("input_scale" in r["metrics"] and "input_zero_point" in r["metrics"] for r in converted)


@torch.no_grad()
def test_smoothing_leaves_the_float_model_unchanged(tiny):
    loaded = tiny()
    model = loaded.model
    before = model(ids())
    op = Int8Pass(Int8Options(smoothing="all", smoothing_strength=0.7))
    groups = op._groups(model)
    context = PassContext(loaded.tokenizer, PipelineConfig.from_dict({"calibration": CALIB}).calibration)
    ranges = op._statistics(model, context, {f"layers.{i}.{g.linears[0]}": InputRequest(channel_range=True)
                                             for i, g in groups}, "ranges")
    norm_before = model.layers[0].input_layernorm.weight.clone()
    columns = smooth(model, groups, ranges, 0.7)
    assert not torch.equal(model.layers[0].input_layernorm.weight, norm_before)  # it did fold something
    assert rel(model(ids()), before) < 1e-5
    # a static range taken before smoothing, divided by the column scales, is the one taken after it
    after = op._statistics(model, context, {n: InputRequest(channel_range=True) for n in ranges}, "ranges")
    for name in ranges:
        scale, zero = static_qparams(ranges[name], False, columns=columns[name])
        scale_after, zero_after = static_qparams(after[name], False)
        assert abs(scale - scale_after) <= 1e-5 * scale_after and abs(zero - zero_after) <= 1, name


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
@torch.no_grad()
def test_the_per_group_strengths_have_the_least_layer_error(tiny, scheme):
    """Each group's searched α is the grid's least output error on its rows: their sum is below
    every single α's, on a model with an outlier channel."""
    loaded = tiny()
    model = loaded.model
    for layer in model.layers:
        layer.input_layernorm.weight[3] *= 40
    op = Int8Pass(Int8Options(activation_scheme=scheme, smoothing_grid=[0.2, 0.5, 0.8]))
    groups = op._groups(model)
    context = PassContext(loaded.tokenizer, PipelineConfig.from_dict({"calibration": CALIB}).calibration)
    ranges = op._statistics(model, context, {f"layers.{i}.{g.linears[0]}": InputRequest(channel_range=True, rows=64)
                                             for i, g in groups}, "ranges")
    searched = op._search_per_group(model, groups, ranges)

    def total(alphas):
        errors = []
        for (i, g), a in zip(groups, alphas):
            stats = ranges[f"layers.{i}.{g.linears[0]}"]
            references = float_outputs(model.layers[i], g, stats.rows)
            errors.append(op._group_error(model.layers[i], g, model.config, stats, references, a))
        return sum(errors)

    singles = {a: total([a] * len(groups)) for a in (0.2, 0.5, 0.8)}
    print(searched, total(searched), singles)
    assert len(set(searched)) > 1  # the groups disagree: one α does not suit all
    assert all(total(searched) < single for single in singles.values())


@torch.no_grad()
def test_smoothquant_moves_an_outlier_channel_into_the_weights(tiny, tmp_path):
    """An input channel 40x larger than the rest sets every token's INT8 step; smoothing divides it
    back down, so q/k/v's error with smoothing is far below that without."""
    errors = {}
    for smoothing in ("none", "norms"):
        loaded = tiny()
        for layer in loaded.model.layers:
            layer.input_layernorm.weight[3] *= 40
        result = compile_loaded(loaded, pipeline(smoothing=smoothing, smoothing_strength=0.5), tmp_path / smoothing)
        rows = read_manifest(result.path).reports[-1]["layers"]
        errors[smoothing] = max(r["metrics"]["output_error"] for r in rows if r["module"].endswith("q_proj"))
    print(errors)
    assert errors["norms"] < errors["none"] / 3


@torch.no_grad()
def test_static_range_search_beats_the_whole_range_on_outlier_tokens():
    """2% of the tokens 30x larger set a static min/max range whose steps crush every other token's;
    the search shrinks the range (saturating those few) where that lowers the layer's error."""
    from compiler.pipeline.calibration import InputStatistics

    torch.manual_seed(0)
    x = torch.randn(512, 64)
    x[::50] *= 30
    stats = InputStatistics(InputRequest(channel_range=True, rows=512), 64)
    stats.add(x)
    errors, clips = {}, {}
    for static_range in ("minmax", "search"):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(64, 32))
        op = Int8Pass(Int8Options(activation_scheme="static", weight_rounding="nearest", static_range=static_range))
        row = op._convert(model, "0", stats)
        errors[static_range], clips[static_range] = row.metrics["token_rel_error"], row.metrics["static_clip"]
        assert isinstance(model[0], Int8Linear)
    print(errors, clips)
    assert clips["minmax"] == 1.0 and clips["search"] < 1.0
    assert errors["search"] < errors["minmax"] / 3


def test_the_strength_is_chosen_on_the_validation_split(tiny, tmp_path, monkeypatch):
    import compiler.pipeline as pipeline_module

    regions = []
    real = pipeline_module.evaluation_windows

    def spy(tokens, windows, eval_len):
        regions.append(tokens)
        return real(tokens, windows, eval_len)

    monkeypatch.setattr(pipeline_module, "evaluation_windows", spy)
    loaded = tiny()
    result = compile_loaded(loaded, pipeline(smoothing_grid=[0.2, 0.5, 0.8], validation_windows=2), tmp_path / "a")
    metrics = read_manifest(result.path).reports[-1]["metrics"]
    scores = metrics["validation_kl_by_strength"]
    assert set(scores) == set(metrics["validation_nll_by_strength"]) == {"0.2", "0.5", "0.8", "per group"}
    chosen = min(scores, key=scores.get)
    assert metrics["smoothing_strength"] == (chosen if chosen == "per group" else float(chosen))
    if chosen == "per group":
        assert len(metrics["smoothing_strength_by_group"]) == 2 * 4  # 2 layers, 4 groups each
    from compiler.pipeline.evaluate import corpus_split
    split = corpus_split(loaded.tokenizer, "pydoc")
    assert len(regions) == 1 and torch.equal(regions[0], split.validation)


@torch.no_grad()
def test_the_engine_fuses_int8_projections_of_one_input(tiny, tmp_path):
    for options in ({}, {"activation_scheme": "static"}):
        loaded = tiny()
        result = compile_loaded(loaded, pipeline(smoothing_strength=0.5, **options), tmp_path / str(len(options)))
        model = load_artifact(result.path).model
        before = model(ids())
        outcome = fuse_projections(model)
        assert len(outcome["fused"]) == 4, outcome
        assert isinstance(model.layers[0].self_attn.qkv_proj, Int8Linear)
        assert torch.equal(model(ids()), before)


@pytest.mark.parametrize("options, says", [
    ({"smoothing_strength": 1.5}, "numbers in \\[0, 1\\]"),
    ({"smoothing_grid": []}, "numbers in \\[0, 1\\]"),
    ({"activation_scheme": "none", "activation_symmetric": False}, "needs INT8 activations"),
    ({"activation_scheme": "sometimes"}, "activation_scheme"),
    ({"validation_windows": 0}, "validation_windows"),
    ({"modules_to_not_convert": ["lm_haed"]}, "lm_haed"),
    ({"dynamic_fallback": 2}, "dynamic_fallback keeps units of a static model dynamic"),
    ({"activation_scheme": "static", "dynamic_fallback": -1}, "dynamic_fallback must be >= 0"),
    ({"activation_scheme": "static", "dynamic_fallback": 9}, "dynamic_fallback = 9, but this model has 8 units"),
])
def test_bad_options_are_refused_before_any_work(tiny, tmp_path, options, says):
    with pytest.raises((ConfigError, PipelineValidationError, ValueError), match=says):
        compile_loaded(tiny(), pipeline(**options), tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_mixture_of_experts_is_refused_in_one_line(tmp_path):
    from arch_helpers import make_arch_model

    from compiler.model.config import ModelConfig

    config = ModelConfig.from_hf(make_arch_model("qwen3-moe").config.to_dict())
    with pytest.raises(ConfigError, match="does not handle Qwen3MoeForCausalLM.*fp8 or awq"):
        Int8Pass(Int8Options()).check(meta_model(config))


# -- the INT8 KV cache (kv_cache_dtype = "int8") -------------------------------------------------
class CaptureKV(torch.nn.Module):
    """Test double in the kv_quant slot: keeps every K (after RoPE) and V it sees, unchanged."""

    def __init__(self):
        super().__init__()
        self.k, self.v = [], []

    def forward(self, k, v):
        self.k.append(k.detach().clone())
        self.v.append(v.detach().clone())
        return k, v


@torch.no_grad()
def test_int8_kv_cache_scales_are_the_calibration_abs_max_per_channel(tiny, tmp_path):
    """The entry holds, per layer, n_kv_heads × head_dim scales of K and of V: amax / 127 over the K/V
    the quantized model computes on the calibration windows, rounded up onto bfloat16's grid."""
    from compiler.formats.kv_quant import Int8KVQuant

    loaded = tiny()
    result = compile_loaded(loaded, pipeline(smoothing_strength=0.5, kv_cache_dtype="int8"), tmp_path / "a")
    entry = read_manifest(result.path).kv_cache
    c = loaded.model.config
    assert entry["dtype"] == "int8" and entry["granularity"] == "per_channel"
    assert [len(s) for s in entry["k_scale"]] == [len(s) for s in entry["v_scale"]] == [c.n_kv_heads * c.head_dim] * 2
    # K/V of the artifact's model (INT8 weights) without its rounding, over the pass's calibration windows
    model = load_artifact(result.path).model
    captures = [CaptureKV() for _ in model.layers]
    for layer, capture in zip(model.layers, captures):
        layer.self_attn.kv_quant = capture
    context = PassContext(loaded.tokenizer, PipelineConfig.from_dict({"calibration": CALIB}).calibration)
    model(context.calibration_windows())
    for i, capture in enumerate(captures):
        for key, seen in (("k_scale", capture.k), ("v_scale", capture.v)):
            amax = torch.cat(seen, dim=2).abs().amax(dim=(0, 2)).flatten()  # [Hkv * D], head-major
            scale = torch.tensor(entry[key][i])
            # the least bfloat16 value at or above amax / 127: on the grid, holding amax, the one below not
            assert torch.equal(scale.to(torch.bfloat16).float(), scale), (i, key)
            assert (amax / 127 <= scale).all() and (scale <= amax / 127 * (1 + 2 ** -7)).all(), (i, key)
            below = (scale.view(torch.int32) - 0x10000).view(torch.float32)
            assert (below < amax / 127).all(), (i, key)
    assert isinstance(loaded.model.layers[0].self_attn.kv_quant, Int8KVQuant)  # installed in the compiled model
    assert read_manifest(result.path).reports[-1]["metrics"]["kv_cache"] == "int8 per_channel"


@torch.no_grad()
def test_int8_kv_cache_artifact_round_trip_rounds_k_and_v(tiny, tmp_path):
    """The reloaded artifact installs the rounding and gives the compiled model's logits; without it
    the logits differ (the rounding is there), and rounding twice is rounding once."""
    from compiler.formats.kv_quant import Int8KVQuant

    loaded = tiny()
    result = compile_loaded(loaded, pipeline(smoothing_strength=0.5, kv_cache_dtype="int8"), tmp_path / "a")
    in_memory = loaded.model(ids())
    reloaded = load_artifact(result.path).model
    quant = reloaded.layers[0].self_attn.kv_quant
    assert isinstance(quant, Int8KVQuant) and quant.k_scale.shape == (reloaded.config.n_kv_heads * reloaded.config.head_dim,)
    assert torch.equal(reloaded(ids()), in_memory)
    for layer in reloaded.layers:
        layer.self_attn.kv_quant = None
    assert not torch.equal(reloaded(ids()), in_memory)
    k = torch.randn(2, reloaded.config.n_kv_heads, 9, reloaded.config.head_dim) * 3
    once = quant(k, k)[0]
    assert torch.equal(quant(once, once)[0], once)
    # codes within int8, clamped at -128 (symmetric scales reach 127 at the calibrated abs-max)
    codes = once / quant.k_scale.reshape(1, -1, 1, reloaded.config.head_dim)
    assert torch.equal(codes, codes.round()) and codes.min() >= -128 and codes.max() <= 127
    big = -1000 * quant.k_scale.reshape(1, -1, 1, reloaded.config.head_dim).expand_as(k)
    assert torch.equal(quant(big, big)[0], -128 * quant.k_scale.reshape(1, -1, 1, reloaded.config.head_dim).expand_as(k))


@pytest.mark.parametrize("change, says", [
    (lambda e: e["k_scale"][0].pop(), "k_scale must hold 2 layers × 32 positive scales"),
    (lambda e: e["v_scale"][1].__setitem__(3, -0.5), "v_scale must hold 2 layers × 32 positive scales"),
    (lambda e: e.__setitem__("granularity", "per_head"), "expected an FP8 dtype per_tensor or per_head, or int8 per_channel"),
])
def test_a_corrupt_int8_kv_entry_is_refused_at_load(tiny, tmp_path, change, says):
    from artifact_helpers import read_raw_manifest, rewrite_manifest

    from compiler.errors import ArtifactError

    result = compile_loaded(tiny(), pipeline(smoothing_strength=0.5, kv_cache_dtype="int8"), tmp_path / "a")
    manifest = read_raw_manifest(result.path)
    change(manifest["kv_cache"])
    rewrite_manifest(result.path, manifest)
    with pytest.raises(ArtifactError, match=says) as err:
        load_artifact(result.path)
    assert "\n" not in str(err.value)


def test_one_pass_declares_the_kv_cache(tiny, tmp_path):
    config = PipelineConfig.from_dict({"calibration": CALIB, "passes": [
        {"name": "fp8", "convert_linears": False, "kv_cache_dtype": "float8_e4m3fn"},
        {"name": "int8", "kv_cache_dtype": "int8"}]})
    with pytest.raises(PipelineValidationError, match=r"passes\[1\] \(int8\): kv_cache_dtype: passes\[0\] \(fp8\) "
                                                      "already declares the KV cache") as err:
        compile_loaded(tiny(), config, tmp_path / "a")
    assert "\n" not in str(err.value) and not (tmp_path / "a").exists()


def test_dynamic_fallback_ranks_the_unit_whose_static_range_costs_the_model_most(tiny, tmp_path, monkeypatch):
    """One down_proj's calibrated range widened 50x by two huge tokens: its static steps then
    crush every token, the model's KL from float with it alone dynamic drops most, and it goes first."""
    real = Int8Pass._statistics

    def widened(self, model, context, requests, label):
        stats = real(self, model, context, requests, label)
        if label == "int8: calibrating":
            down = stats["layers.1.mlp.down_proj"]
            down.add(torch.stack([down.channel_min, down.channel_max]) * 50)  # two huge tokens
        return stats

    monkeypatch.setattr(Int8Pass, "_statistics", widened)
    result = compile_loaded(tiny(), pipeline(activation_scheme="static", smoothing_strength=0.5, dynamic_fallback=2,
                                             validation_windows=2), tmp_path / "a")
    report = read_manifest(result.path).reports[-1]
    note = next(n for n in report["notes"] if "keep dynamic symmetric activations" in n)
    print(note)
    assert note.rpartition("dynamic): ")[2].startswith("layers.1.mlp.down_proj ")  # the costliest, named first
    assert "layers.1.mlp.down_proj" in report["metrics"]["dynamic_fallback"]


def test_dynamic_fallback_plans_the_dynamic_formats(tiny):
    model = tiny().model
    op = Int8Pass(Int8Options(activation_scheme="static", dynamic_fallback=2))
    candidates = op._select(model)[0]
    assert len(op._units(candidates)) == 2 * 4  # q/k/v, o, gate/up, down in each of 2 layers
    alternatives = op.plan(model).alternatives  # what the target is checked for before any work
    assert set(alternatives) == set(candidates)
    assert all(f["activation_scheme"] == "dynamic" and f["activation_symmetric"] for f in alternatives.values())


@torch.no_grad()
def test_dynamic_fallback_keeps_whole_units_dynamic_and_reloads(tiny, tmp_path):
    loaded = tiny()
    result = compile_loaded(loaded, pipeline(activation_scheme="static", smoothing_strength=0.5, dynamic_fallback=3),
                            tmp_path / "a")
    in_memory = loaded.model(ids())
    assert torch.equal(load_artifact(result.path).model(ids()), in_memory)
    manifest = read_manifest(result.path)
    dynamic = sorted(n for n, m in manifest.modules.items() if m["activation_scheme"] == "dynamic")
    assert dynamic == manifest.reports[-1]["metrics"]["dynamic_fallback"]
    assert all(manifest.modules[n]["activation_symmetric"] for n in dynamic)
    units = Int8Pass._units(list(manifest.modules))
    # at most 3 whole units (one whose dynamic activations gain nothing stays static)
    assert 1 <= sum(set(u) <= set(dynamic) for u in units) <= 3
    assert all(set(u) <= set(dynamic) or not set(u) & set(dynamic) for u in units)
    rows = {r["module"]: r for r in manifest.reports[-1]["layers"]}
    assert all(("input_scale" in rows[n]["metrics"]) == (n not in dynamic) for n in manifest.modules)
    assert any("keep dynamic symmetric activations" in note for note in manifest.reports[-1]["notes"])
