"""One KV-cache plan: the paged_kv pass computes it (``plan_kv_cache``) and records it in the
manifest, the engine builds its cache from the recorded plan; an FP8 cache's need for calibrated
scales is paged_kv's ``requires``, refused before any pass runs."""
from __future__ import annotations

import json

import pytest
from artifact_helpers import rewrite_manifest

import passes  # noqa: F401  (registers paged_kv and fp8)
from compiler.deploy.serving_plan import KVCachePlan, ServingPlan, plan_kv_cache
from compiler.errors import ConfigError, PipelineValidationError
from compiler.io.load import load_checkpoint
from compiler.model.config import ModelConfig
from compiler.pipeline import PASSES, Pipeline, PipelineConfig
from compiler.pipeline.compile import compile_model
from serving.engine import Engine

BUDGET_MB = 0.05  # a few blocks of the tiny model: the count comes from the budget, not a num_blocks


def test_the_engine_builds_the_cache_the_pass_recorded(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint()
    result = compile_model(path, PipelineConfig.from_dict({"passes": [
        {"name": "paged_kv", "block_size": 8, "kv_memory_mb": BUDGET_MB}]}), tmp_path / "art")
    recorded = json.loads((result.path / "manifest.json").read_text())["serving"]
    metrics = result.reports[-1].metrics
    assert recorded["num_blocks"] == metrics["num_blocks"] > 1 and recorded["kv_dtype"] == metrics["kv_dtype"] == "float32"
    engine = Engine.from_artifact(result.path, "cpu")
    plan = engine.load_report.kv_cache
    assert isinstance(plan, KVCachePlan) and (plan.kv_dtype, plan.num_blocks, plan.block_size) == ("float32", recorded["num_blocks"], 8)
    assert engine.cache.spec.num_blocks == recorded["num_blocks"] and round(plan.mib, 2) == metrics["kv_cache_mib"]
    # the engine reads the recorded plan, it does not plan again from the memory budget
    manifest = json.loads((result.path / "manifest.json").read_text())
    manifest["serving"]["num_blocks"] -= 1
    rewrite_manifest(result.path, manifest)
    assert Engine.from_artifact(result.path, "cpu").cache.spec.num_blocks == recorded["num_blocks"] - 1
    # and a model without a recorded plan gets the same cache from the same budget (one planning function)
    unplanned = Engine.from_loaded(load_checkpoint(path), "cpu", block_size=8, kv_memory_mb=BUDGET_MB)
    assert unplanned.load_report.kv_cache == plan


CONFIG = ModelConfig("LlamaForCausalLM", vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     intermediate_size=96)


# (paged_kv's kv_dtype, the pass whose scales it needs, passes before it that provide none)
WITHOUT_SCALES = [("float8_e4m3fn", "fp8", []), ("float8_e4m3fn", "fp8", [{"name": "fp8", "kv_cache_dtype": "none"}]),
                  ("float8_e4m3fn", "fp8", [{"name": "fp8", "convert_linears": False, "kv_cache_dtype": "float8_e5m2"}]),
                  ("int8", "int8", []), ("int8", "int8", [{"name": "int8"}]),
                  ("int8", "int8", [{"name": "fp8", "kv_cache_dtype": "float8_e4m3fn"}])]


@pytest.mark.parametrize("kv_dtype,provider,before", WITHOUT_SCALES)
def test_a_quantized_cache_without_its_scales_before_it_is_refused_before_any_pass_runs(kv_dtype, provider, before,
                                                                                         monkeypatch):
    ran = []
    for cls in PASSES.values():
        monkeypatch.setattr(cls, "run", lambda self, *a, **k: ran.append(self.name))
    pipeline = Pipeline(PipelineConfig.from_dict({"passes": [*before, {"name": "paged_kv", "kv_dtype": kv_dtype}]}))
    with pytest.raises(PipelineValidationError, match=rf"\(paged_kv\): requires {provider}_kv_cache, which no earlier "
                                                      rf"pass provides; run {provider} before it") as e:
        pipeline.validate(CONFIG)
    assert "\n" not in str(e.value) and ran == []


@pytest.mark.parametrize("kv_dtype,provider", [("float8_e4m3fn", "fp8"), ("int8", "int8")])
def test_a_quantized_cache_after_its_scales_validates(kv_dtype, provider):
    pipeline = Pipeline(PipelineConfig.from_dict({"passes": [
        {"name": provider, "kv_cache_dtype": kv_dtype}, {"name": "paged_kv", "kv_dtype": kv_dtype}]}))
    pipeline.validate(CONFIG)  # no error: the pass provides the scales paged_kv requires


def test_an_int8_entry_plans_an_int8_cache_of_one_byte_a_value():
    """The int8 pass's entry: "auto" stores int8 codes, a quarter of float32's bytes a block, so the
    same budget buys four times the tokens; an int8 cache without int8 scales is refused in one line."""
    scales = [[0.01] * (CONFIG.n_kv_heads * CONFIG.head_dim)] * CONFIG.n_layers
    entry = {"dtype": "int8", "granularity": "per_channel", "k_scale": scales, "v_scale": scales}
    plan = ServingPlan(kv_memory_mb=1)
    int8, fp32 = plan_kv_cache(plan, CONFIG, "float32", entry), plan_kv_cache(plan, CONFIG, "float32", None)
    assert int8.kv_dtype == "int8" and fp32.kv_dtype == "float32"
    values_per_block = 2 * CONFIG.n_layers * 16 * CONFIG.n_kv_heads * CONFIG.head_dim  # K and V, 16 tokens
    assert int8.bytes_per_block == values_per_block and fp32.bytes_per_block == 4 * values_per_block
    assert int8.max_tokens == 4 * fp32.max_tokens
    assert plan_kv_cache(ServingPlan(kv_dtype="float32"), CONFIG, "float32", entry).kv_dtype == "float32"
    with pytest.raises(ConfigError, match=r"kv_dtype int8 needs K/V scales calibrated for it \(the int8 pass's "
                                          r"kv_cache_dtype = \"int8\"\), and the artifact has no KV-cache scales") as e:
        plan_kv_cache(ServingPlan(kv_dtype="int8"), CONFIG, "float32", None)
    assert "\n" not in str(e.value)
