"""The serving plan's ``int4_compute``: the engine puts every INT4 layer on int8 activations (W4A8)
when asked, says so, keeps greedy parity with the same layers outside the engine, and refuses W4A8
where it cannot run it; the targets that cannot compute W4A8 refuse such a plan."""
from __future__ import annotations

import pytest
import torch

from compiler.errors import ConfigError
from compiler.formats.int4 import Int4Linear
from compiler.io.load import load_checkpoint
from compiler.kernels import w4a8_cpu
from compiler.kernels.cpu_ext import use_isa
from compiler.kernels.dispatch import W4A8, resolve_int4_compute
from serving.engine import Engine
from serving.engine_setup import set_int4_compute
from serving.types import SamplingParams

needs_kernel = pytest.mark.skipif(w4a8_cpu.w4a8_unavailable_reason() is not None,
                                  reason=f"w4a8_linear cannot run here: {w4a8_cpu.w4a8_unavailable_reason()}")
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture
def int4_model(tiny_checkpoint):
    """A tiny llama whose decoder projections are INT4 (round to nearest, group 32)."""
    path, _ = tiny_checkpoint("llama")
    loaded = load_checkpoint(path)
    for layer in loaded.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                setattr(parent, name, Int4Linear.from_float(getattr(parent, name), 32))
    return loaded


def greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    rids = [engine.add_request(prompt_token_ids=p, params=GREEDY) for p in prompts]
    outs = {rid: [] for rid in rids}
    while engine.has_unfinished():
        for rid, event in engine.step().items():
            outs[rid].extend(event.token_ids)
    return [outs[rid] for rid in rids]


@needs_kernel
def test_the_engine_runs_w4a8_when_the_plan_asks_and_keeps_greedy_parity(int4_model):
    prompts = [[5, 9, 17, 3, 44], list(range(3, 30)), [7] * 9]
    reference = Engine.from_loaded(int4_model, "cpu", block_size=4, num_blocks=64, int4_compute="w4a16")
    assert reference.load_report.int4 == {"compute": "w4a16", "asked": "w4a16", "layers": 4 * reference.config.n_layers}  # fused q/k/v, gate/up
    w4a16_tokens = greedy(reference, prompts)
    engine = Engine.from_loaded(int4_model, "cpu", block_size=4, num_blocks=64, int4_compute="w4a8")
    assert engine.load_report.int4["compute"] == "w4a8" and engine.load_report.int4["layers"] == 4 * engine.config.n_layers
    assert engine.load_report.int4["kernel"] == w4a8_cpu.KERNEL and not engine.load_report.int4["w4a16"]
    assert all(m.kernel == w4a8_cpu.KERNEL for m in engine.model.modules() if isinstance(m, Int4Linear))
    # the same W4A8 layers outside the engine (contiguous cache, one sequence at a time)
    want = [engine.model.generate(torch.tensor([p]), GREEDY.max_tokens)[0, len(p):].tolist() for p in prompts]
    assert greedy(engine, prompts) == want
    print(f"W4A8 greedy tokens equal to W4A16's: {sum(a == b for w, g in zip(w4a16_tokens, want) for a, b in zip(w, g))}"
          f" of {len(prompts) * GREEDY.max_tokens}")


def test_w4a8_where_it_cannot_run_is_a_clear_error(int4_model):
    with pytest.raises(ConfigError, match="is a CPU kernel; on cuda INT4 runs W4A16"):
        set_int4_compute(int4_model.model, "w4a8", torch.device("cuda"))
    with use_isa(None), pytest.raises(ConfigError, match=r"cannot run here: qcompile's C\+\+ kernels are not loaded: "
                                                         r"turned off \(use_isa\(None\)\); serve with int4_compute = .w4a16."):
        Engine.from_loaded(int4_model, "cpu", block_size=4, num_blocks=64, int4_compute="w4a8")
    with pytest.raises(ConfigError, match="int4_compute must be one of auto, w4a16, w4a8"):
        Engine.from_loaded(int4_model, "cpu", block_size=4, num_blocks=64, int4_compute="w4a4")


def test_auto_is_w4a8_where_the_cpu_runs_it_and_says_why_not_elsewhere(int4_model):
    """The default plan, "auto": W4A8 on a CPU with qcompile's kernels (reported as asked "auto"),
    W4A16 with the reason where they are not loaded, and W4A16 on a GPU."""
    engine = Engine.from_loaded(int4_model, "cpu", block_size=4, num_blocks=64)
    assert engine.plan.int4_compute == "auto" and engine.load_report.int4["asked"] == "auto"
    assert engine.load_report.int4["compute"] == "w4a8" and engine.load_report.int4["layers"] == 4 * engine.config.n_layers
    assert engine.load_report.kernels["int4"]["decode"] == {W4A8.describe(): 4 * engine.config.n_layers}
    with use_isa(None):
        fallback = Engine.from_loaded(int4_model, "cpu", block_size=4, num_blocks=64)
    assert fallback.load_report.int4["compute"] == "w4a16" and "auto: W4A8 cannot run here (qcompile's C++ kernels are not loaded" in fallback.load_report.int4["why"]
    assert resolve_int4_compute("auto", torch.device("cuda")) == ("w4a16", "auto: W4A8 is a CPU kernel, this engine runs on cuda")
    assert resolve_int4_compute("w4a16", torch.device("cpu")) == ("w4a16", None)


def test_a_float_model_has_no_int4_report(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    assert Engine.from_loaded(load_checkpoint(path), "cpu", block_size=4, num_blocks=32, int4_compute="w4a8").load_report.int4 == {}


def test_vllm_refuses_a_w4a8_plan_for_int4_layers():
    from backends.vllm.schemes import check_plan
    from compiler.deploy.targets import DeploymentPlan

    int4 = {"format": "int4", "group_size": 128, "zero_point": True}
    formats = {f"layers.0.mlp.{name}": int4 for name in ("gate_proj", "up_proj")}
    why = check_plan(DeploymentPlan("float16", formats, serving={"int4_compute": "w4a8"}))
    assert why and "int4_compute \"w4a8\"" in why and "W4A16" in why
    assert check_plan(DeploymentPlan("float16", formats, serving={"int4_compute": "w4a16"})) is None


def test_bench_refuses_engine_settings_for_other_targets(tmp_path):
    from serving.bench.errors import BenchError
    from serving.bench.targets import Target, open_adapter

    with pytest.raises(BenchError, match="--int4-compute: a setting of the in-process engine, for artifact targets only"):
        open_adapter(Target("onnx", str(tmp_path), path=tmp_path), engine_plan={"int4_compute": "w4a8"})


def test_a_pipeline_declares_w4a8_in_its_plan_and_vllm_refuses_it_before_running():
    import backends  # noqa: F401  (registers the vllm target)
    import passes  # noqa: F401  (registers the passes)
    from compiler.model.config import ModelConfig
    from compiler.pipeline import Pipeline, PipelineConfig

    smollm2_like = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, dim=576, n_layers=2, n_heads=9,
                               n_kv_heads=3, intermediate_size=1536)

    def config(compute: str, target: str | None = None) -> PipelineConfig:
        d = {"calibration": {"samples": 4, "seq_len": 64},
             "passes": [{"name": "awq", "group_size": 64}, {"name": "paged_kv", "int4_compute": compute}]}
        return PipelineConfig.from_dict({**d, **({"target": {"name": target}} if target else {})})

    assert Pipeline(config("w4a8")).validate(smollm2_like)
    with pytest.raises(ConfigError, match="int4_compute"):
        Pipeline(config("w4a4")).validate(smollm2_like)
    with pytest.raises(ConfigError, match="target 'vllm' cannot run a serving plan with int4_compute .w4a8."):
        Pipeline(config("w4a8", "vllm")).validate(smollm2_like)
