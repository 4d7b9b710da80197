"""Pipeline files, option parsing and whole-pipeline validation before any pass runs."""
from dataclasses import dataclass, field

import pytest
import torch

from compiler.deploy.targets import TARGETS, Target
from compiler.errors import ConfigError, PassError, PipelineValidationError
from compiler.model.config import ModelConfig
from compiler.pipeline import (
    PASSES,
    Pass,
    PassContext,
    PassPlan,
    PassReport,
    Pipeline,
    PipelineConfig,
)

CONFIG = ModelConfig("LlamaForCausalLM", vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=32)


@dataclass
class ClaimOptions:
    layers: list[str] = field(default_factory=lambda: ["layers.0.mlp.up_proj"])
    group_size: int = 64
    fail: bool = False


class ClaimA(Pass):
    """Test double: claims ``layers`` with a made-up format and provides 'a_done'."""

    name = "test_claim_a"
    Options = ClaimOptions
    provides = frozenset({"a_done"})

    def plan(self, model):
        return PassPlan({m: {"format": "test4", "group_size": self.options.group_size} for m in self.options.layers})

    def run(self, model, context):
        if self.options.fail:
            raise RuntimeError("boom")
        return PassReport(self.name, metrics={"layers": len(self.options.layers)})


class NeedsA(ClaimA):
    name = "test_needs_a"
    requires = frozenset({"a_done"})
    provides = frozenset()


@pytest.fixture(autouse=True)
def registered():
    PASSES.update({c.name: c for c in (ClaimA, NeedsA)})
    TARGETS["test_target"] = Target("test_target", "accepts group 32 only",
                                    lambda m, f: None if f.get("group_size") == 32 else f"group_size {f.get('group_size')} (needs 32)",
                                    lower=None)  # validation only
    yield
    for c in (ClaimA, NeedsA):
        PASSES.pop(c.name)
    TARGETS.pop("test_target")


def pipeline(passes, **sections):
    return Pipeline(PipelineConfig.from_dict({"passes": passes, **sections}))


def test_toml_round_trip(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text('[model]\ndtype = "bfloat16"\n[calibration]\nsamples = 8\nseq_len = 64\n[[passes]]\nname = "test_claim_a"\ngroup_size = 32\n')
    config = PipelineConfig.from_toml(f)
    assert config.model.dtype == "bfloat16" and config.calibration.samples == 8
    assert PipelineConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()


def test_no_passes_is_valid():
    assert pipeline([]).validate(CONFIG).formats == {}


@pytest.mark.parametrize("doc, message", [
    ({"modle": {}}, r"unknown section \[modle\]; did you mean 'model'\?"),
    ({"calibration": {"sampels": 4}}, r"\[calibration\]: unknown option 'sampels'; did you mean 'samples'\?"),
    ({"calibration": {"samples": "many"}}, r"option 'samples' must be int"),
    ({"calibration": {"samples": 0}}, r"samples must be >= 1"),
    ({"model": {"dtype": "float64"}}, r"option 'dtype' must be 'float32' \| 'bfloat16' \| 'float16'"),
    ({"passes": [{"name": "test_claim_b"}]}, r"passes\[0\]: unknown pass 'test_claim_b'; did you mean 'test_claim_a'\?"),
    ({"passes": [{"group_size": 4}]}, r"passes\[0\]: every \[\[passes\]\] entry needs a name"),
    ({"passes": [{"name": "test_claim_a", "grup_size": 4}]}, r"passes\[0\] \(test_claim_a\): unknown option 'grup_size'; did you mean 'group_size'\?"),
])
def test_bad_configs_name_the_offending_entry(doc, message):
    with pytest.raises(ConfigError, match=message):
        Pipeline(PipelineConfig.from_dict(doc))


def test_bad_toml(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        PipelineConfig.from_toml(f)
    with pytest.raises(ConfigError, match="not found"):
        PipelineConfig.from_toml(tmp_path / "missing.toml")


def test_impossible_order():
    p = pipeline([{"name": "test_needs_a", "layers": ["layers.1.mlp.up_proj"]}, {"name": "test_claim_a"}])
    with pytest.raises(PipelineValidationError, match=r"passes\[0\] \(test_needs_a\): requires a_done.*run test_claim_a before it"):
        p.validate(CONFIG)
    pipeline([{"name": "test_claim_a"}, {"name": "test_needs_a", "layers": ["layers.1.mlp.up_proj"]}]).validate(CONFIG)


def test_two_passes_claiming_one_layer():
    p = pipeline([{"name": "test_claim_a"}, {"name": "test_needs_a"}])
    with pytest.raises(PipelineValidationError, match=r"passes\[1\] \(test_needs_a\): layer layers.0.mlp.up_proj is already claimed by passes\[0\]"):
        p.validate(CONFIG)


def test_target_constraints_fail_validation():
    p = pipeline([{"name": "test_claim_a", "group_size": 64}], target={"name": "test_target"})
    with pytest.raises(PipelineValidationError, match=r"target 'test_target' cannot run layers.0.mlp.up_proj: group_size 64"):
        p.validate(CONFIG)
    pipeline([{"name": "test_claim_a", "group_size": 32}], target={"name": "test_target"}).validate(CONFIG)
    with pytest.raises(ConfigError, match="unknown target 'test_targt'; did you mean 'test_target'"):
        pipeline([{"name": "test_claim_a"}], target={"name": "test_targt"}).validate(CONFIG)


def test_pass_failure_names_pass_and_history():
    p = pipeline([{"name": "test_claim_a", "layers": []}, {"name": "test_needs_a", "fail": True}])
    ctx = PassContext(tokenizer=None, calibration=p.config.calibration)
    with pytest.raises(PassError, match=r"pass test_needs_a \(passes\[1\], after test_claim_a\) failed: RuntimeError: boom"):
        p.run(torch.nn.Linear(2, 2), ctx)


def test_reports_carry_options_and_time():
    p = pipeline([{"name": "test_claim_a", "group_size": 32}])
    reports = p.run(torch.nn.Linear(2, 2), PassContext(tokenizer=None, calibration=p.config.calibration))
    assert reports[0].options["group_size"] == 32 and reports[0].wall_time_s >= 0 and reports[0].metrics == {"layers": 1}


def test_a_mixed_calibration_corpus_draws_half_its_windows_from_each(byte_tokenizer):
    from calib import CalibrationConfig, load_corpus_text, split_tokens

    context = PassContext(byte_tokenizer, CalibrationConfig(corpus="pydoc+stdlib-docs", samples=6, seq_len=32))
    windows = context.calibration_windows()
    pools = [split_tokens(byte_tokenizer(load_corpus_text(c), add_special_tokens=False)["input_ids"]).pool
             for c in ("pydoc", "stdlib-docs")]

    def inside(window, pool):
        return any(torch.equal(pool[i : i + len(window)], window) for i in torch.nonzero(pool == window[0]).flatten())

    assert windows.shape == (6, 32)
    assert all(inside(w, pools[0]) for w in windows[:3]) and all(inside(w, pools[1]) for w in windows[3:])


def test_a_model_that_overflows_float16_is_refused_in_float16_before_any_work():
    gemma = ModelConfig("Gemma3ForCausalLM", vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
                        intermediate_size=32)
    pipeline = Pipeline(PipelineConfig.from_dict({"model": {"dtype": "float16"}, "passes": [{"name": "test_claim_a"}]}))
    with pytest.raises(PipelineValidationError, match=r"model.dtype float16: Gemma3ForCausalLM cannot run in float16, "
                                                      r"its activations pass float16's largest value.*set dtype = \"bfloat16\""):
        pipeline.validate(gemma)
    for dtype in ("bfloat16", "float32"):
        Pipeline(PipelineConfig.from_dict({"model": {"dtype": dtype}, "passes": [{"name": "test_claim_a"}]})).validate(gemma)
    Pipeline(PipelineConfig.from_dict({"model": {"dtype": "float16"}, "passes": [{"name": "test_claim_a"}]})).validate(CONFIG)
