"""AWQ and FP8 on DeepSeek-V3 (multi-head latent attention, grouped router, shared and routed
experts): the scaling folds are exact (the float router takes the scales too), the group-size
plan covers MLA's ranks and the expert widths, both passes compile a tiny checkpoint that
reloads to the same model, which the engine serves, and an expert the router never picks gets a
recorded decision (the starved-expert policy of passes/moe_calibration.py), never silent
calibration on nothing."""
from __future__ import annotations

import pytest
import torch
from arch_helpers import make_arch_model

import passes  # noqa: F401  (registers the passes)
from calib import CalibrationConfig
from compiler.errors import ConfigError, PipelineValidationError
from compiler.formats.fp8 import Fp8Linear
from compiler.formats.int4 import Int4Linear
from compiler.io.artifact import load_artifact
from compiler.io.load import load_checkpoint
from compiler.kernels.dense_cpu import pack_linears
from compiler.model.config import ModelConfig
from compiler.model.deepseek_moe import GroupedTopkRouter
from compiler.pipeline import PassContext, Pipeline, PipelineConfig
from compiler.pipeline.calibration import TokenSampler
from compiler.pipeline.compile import compile_loaded
from compiler.pipeline.selection import meta_model
from passes.awq import BlockQuantizer, capture
from passes.awq_mappings import expand_columns, fold_scales, layer_groups
from passes.awq_plan import AWQOptions, plan_layers
from serving.engine import Engine

CALIB = {"corpus": "pydoc", "samples": 4, "seq_len": 64, "seed": 0}


def load(case, tmp_path, tokenizer, never_routed: int | None = None, **overrides):
    """The case's checkpoint with ``tokenizer``'s vocabulary; ``never_routed``: an expert whose
    router bias keeps it out of every token's choice."""
    hf = make_arch_model(case, vocab_size=len(tokenizer), **overrides)
    if never_routed is not None:
        with torch.no_grad():
            for layer in hf.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.e_score_correction_bias[never_routed] = -100.0
    hf.save_pretrained(tmp_path / case)
    tokenizer.save_pretrained(tmp_path / case)
    return load_checkpoint(tmp_path / case)


def pipeline(name, **options) -> PipelineConfig:
    return PipelineConfig.from_dict({"calibration": CALIB, "passes": [{"name": name, **options}]})


@pytest.mark.parametrize("case", ["deepseek-v3", "deepseek-v3-q-proj-yarn"])
@torch.no_grad()
def test_awq_folds_leave_the_float_model_unchanged(case, tmp_path, byte_tokenizer):
    """Searched scales (module scoring included), then large random ones on every group: logits
    stay put, routing included (the router's columns take post_attention_layernorm's scales)."""
    loaded = load(case, tmp_path, byte_tokenizer)
    model = loaded.model
    ids = torch.randint(3, len(byte_tokenizer), (2, 40), generator=torch.Generator().manual_seed(3))
    before = model(ids)
    opts = AWQOptions(group_size=32)
    plans, _ = plan_layers(model, opts)
    ctx = PassContext(tokenizer=loaded.tokenizer, calibration=CalibrationConfig(samples=4, seq_len=64))
    windows = ctx.calibration_windows()
    positions = torch.arange(windows.shape[1]).expand(opts.batch_size, -1)
    x = model.embed_tokens(windows)
    cos, sin = model.rope(positions, x.dtype)
    gen = torch.Generator().manual_seed(5)
    for i, block in enumerate(model.layers):
        sample = (x[:2], cos[:2], sin[:2], positions[:2])
        sampler = TokenSampler(opts.search_tokens, windows.numel(), torch.Generator().manual_seed(0))
        groups = layer_groups(model.config, i)
        x, stats = capture(block, groups, x, cos, sin, positions, sampler)
        worker = BlockQuantizer(model, f"layers.{i}.", plans, opts, None, groups)
        worker.inspected = worker._inspect_modules(sample)
        rows, _ = worker.search_and_fold(stats)
        assert {r.module.removeprefix(f"layers.{i}.") for r in rows.values()} == \
            {n.removeprefix(f"layers.{i}.") for n in plans if n.startswith(f"layers.{i}.")}
        for group in worker.groups:
            if group.prev is not None:
                s = torch.rand(block.get_submodule(group.prev).weight.shape[0], generator=gen) * 4 + 0.25
                expand = expand_columns(block, group, model.config)
                fold_scales(block, group, s, s if expand is None else s[expand])
    rel = float((model(ids) - before).norm() / before.norm())
    assert rel < 1e-5, f"folding changed the logits by {rel:.2e}"


def test_group_size_plan_covers_mla_ranks_and_expert_widths(tmp_path, byte_tokenizer):
    config = load("deepseek-v3", tmp_path, byte_tokenizer, kv_lora_rank=48, q_lora_rank=80,
                  moe_intermediate_size=40).model.config
    with pytest.raises(ConfigError) as info:
        plan_layers(meta_model(config), AWQOptions(group_size=32, group_size_policy="fallback"))
    msg = str(info.value)
    assert "self_attn.kv_b_proj (in_features 48)" in msg
    assert "self_attn.q_b_proj (in_features 80)" in msg
    assert "mlp.experts.0.down_proj" in msg and "mlp.shared_experts.down_proj" in msg and "in_features 40" in msg
    padded, _ = plan_layers(meta_model(config), AWQOptions(group_size=32, group_size_policy="pad"))
    assert padded["layers.1.self_attn.kv_b_proj"].format(True)["padded_in_features"] == 64
    assert not any(n.endswith("mlp.gate") for n in padded)  # the router is no Linear: never planned


@torch.no_grad()
def test_awq_compiles_deepseek_and_the_engine_serves_it(tmp_path, byte_tokenizer):
    loaded = load("deepseek-v3", tmp_path, byte_tokenizer, never_routed=7)
    ids = torch.randint(3, len(byte_tokenizer), (2, 24), generator=torch.Generator().manual_seed(7))
    result = compile_loaded(loaded, pipeline("awq", group_size=32), tmp_path / "awq")
    reloaded = load_artifact(result.path)
    model = reloaded.model
    c = model.config
    planned, _ = plan_layers(meta_model(c), AWQOptions(group_size=32))
    int4 = {n for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert int4 == set(planned) and "layers.1.self_attn.o_proj" in int4
    assert all(isinstance(layer.mlp.gate, GroupedTopkRouter) and layer.mlp.gate.weight.dtype == torch.float32
               for layer in model.layers[1:])
    assert torch.equal(model(ids), result.loaded.model(ids))
    # Logits of random-weight MoE models move far under any INT4 (RTN too: the routing flips), so
    # the quality check is per layer: AWQ's output error on the calibration tokens against RTN's.
    report = reloaded.manifest.reports[-1]
    assert report["metrics"]["mean_output_error"] < 0.8 * report["metrics"]["mean_rel_error_rtn"]
    rows = {r["module"]: r for r in report["layers"]}
    assert max(r["metrics"]["output_error"] for r in rows.values() if r["format"] == "int4") < 0.15
    # The never-routed expert is starved: by default calibrated on every token of its layer.
    never = rows["layers.1.mlp.experts.7.down_proj"]
    assert never["metrics"]["expert_tokens"] == 0 and never["metrics"]["calibration_tokens"] > 0
    assert "expert routed 0 of" in never["reason"] and "starved_experts = 'all_tokens'" in never["reason"]
    assert rows["layers.1.mlp.experts.0.down_proj"]["metrics"]["expert_tokens"] > 0
    assert rows["layers.1.mlp.gate"]["format"] == "float"
    prompt = ids[0, :9].tolist()
    want = model.generate(torch.tensor([prompt]), 8)[0, 9:].tolist()
    engine = Engine.from_loaded(reloaded, "cpu", block_size=4, num_blocks=16)
    assert engine.generate(prompt_token_ids=prompt, max_tokens=8, ignore_eos=True).token_ids == want


@torch.no_grad()
def test_fp8_compiles_deepseek_and_keeps_an_unrouted_expert_float(tmp_path, byte_tokenizer):
    loaded = load("deepseek-v3", tmp_path, byte_tokenizer, never_routed=7)
    ids = torch.randint(3, len(byte_tokenizer), (2, 24), generator=torch.Generator().manual_seed(7))
    result = compile_loaded(loaded, pipeline("fp8", max_layer_error=10.0, starved_experts="float"), tmp_path / "fp8")
    reloaded = load_artifact(result.path)
    model = reloaded.model
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert "layers.1.self_attn.kv_b_proj" in fp8 and "layers.1.mlp.experts.0.down_proj" in fp8
    unrouted = {n for n in model.state_dict() if ".experts.7." in n}
    assert unrouted and not any(".experts.7." in n for n in fp8)
    rows = {r["module"]: r for r in reloaded.manifest.reports[-1]["layers"]}
    assert rows["layers.1.mlp.experts.7.up_proj"]["format"] == "float"
    assert "expert routed 0 of" in rows["layers.1.mlp.experts.7.up_proj"]["reason"]
    assert rows["layers.1.mlp.experts.0.up_proj"]["metrics"]["expert_tokens"] > 0
    assert torch.equal(model(ids), result.loaded.model(ids))
    errors = [r["metrics"]["output_error"] for r in rows.values() if r["format"] == "fp8"]
    assert len(errors) == len(fp8) and max(errors) < 0.1, max(errors)
    prompt = ids[0, :9].tolist()
    reference = load_artifact(result.path).model
    pack_linears(reference)  # the engine's GEMMs: MKL's would flip an FP8 activation code now and then
    want = reference.generate(torch.tensor([prompt]), 8)[0, 9:].tolist()
    engine = Engine.from_loaded(reloaded, "cpu", block_size=4, num_blocks=16)
    assert engine.generate(prompt_token_ids=prompt, max_tokens=8, ignore_eos=True).token_ids == want


def test_fp8_refuses_an_fp8_latent_cache(tmp_path, byte_tokenizer):
    config: ModelConfig = load("deepseek-v3", tmp_path, byte_tokenizer).model.config
    with pytest.raises(PipelineValidationError, match="kv_cache_dtype is not supported for DeepseekV3ForCausalLM") as info:
        Pipeline(pipeline("fp8", kv_cache_dtype="float8_e4m3fn")).validate(config)
    assert "\n" not in str(info.value)
