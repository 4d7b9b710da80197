"""Qwen3, Gemma 3, Qwen3-MoE, Mixtral and DeepSeek-V3 through the rest of the pipeline: float artifacts
round trip, FP8 compiles the dense ones (and the engine serves them), and whatever cannot handle an
architecture or a config feature refuses it with one line: AWQ at validate time, the ONNX and vLLM
exports, the loader. (AWQ and FP8 on every architecture: tests/passes/test_awq_architectures.py,
test_moe_calibration.py, test_passes_deepseek.py.)"""
from __future__ import annotations

import json

import pytest
import torch
from arch_helpers import make_arch_model
from numerics import relative_error

import backends  # noqa: F401  (registers the lowerings)
import passes  # noqa: F401  (registers the passes)
from backends.onnx.export import OnnxExportOptions, export_graphs
from compiler.deploy.lowering import lower
from compiler.errors import CheckpointError, ConfigError, PipelineValidationError
from compiler.formats.fp8 import Fp8Linear
from compiler.io.artifact import load_artifact, save_artifact
from compiler.io.load import load_checkpoint
from compiler.io.types import SourceInfo
from compiler.model.config import ModelConfig
from compiler.pipeline import Pipeline, PipelineConfig
from compiler.pipeline.compile import compile_loaded
from serving.engine import Engine

CALIB = {"corpus": "pydoc", "samples": 4, "seq_len": 64, "seed": 0}
IDS = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(7))


def saved(case, tmp_path, tokenizer=None):
    path = tmp_path / case
    make_arch_model(case, **({"vocab_size": len(tokenizer)} if tokenizer else {})).save_pretrained(path)
    if tokenizer:
        tokenizer.save_pretrained(path)
    return path


def pipeline(name, **options) -> PipelineConfig:
    return PipelineConfig.from_dict({"calibration": CALIB, "passes": [{"name": name, **options}]})


@pytest.mark.parametrize("case", ["qwen3", "gemma3-scalar-linear-rope-softcap", "qwen3-moe", "mixtral-sliding",
                                  "deepseek-v3-q-proj-yarn"])
@torch.no_grad()
def test_float_artifact_round_trip(case, tmp_path):
    loaded = load_checkpoint(saved(case, tmp_path), with_tokenizer=False)
    out = save_artifact(tmp_path / "artifact", loaded.model, None, SourceInfo("x", "hf", "0" * 64), {}, [])
    reloaded = load_artifact(out).model
    assert reloaded.config == loaded.model.config
    want = loaded.model.state_dict()
    assert all(torch.equal(t, want[k]) and t.dtype == want[k].dtype for k, t in reloaded.state_dict().items())
    # The same weights give the same logits up to float32 rounding, not bit for bit: MKL's sgemm
    # sums in an order that depends on the address alignment of the memory-mapped tensors, which
    # differs between the checkpoint and the artifact (seen on a 32 x 64 expert projection: 4.8e-7).
    assert relative_error(reloaded(IDS), loaded.model(IDS)) < 1e-6


@pytest.mark.parametrize("case", ["qwen3", "gemma3"])
@torch.no_grad()
def test_fp8_compiles_dense_architectures_and_the_engine_serves_them(case, tmp_path, byte_tokenizer):
    loaded = load_checkpoint(saved(case, tmp_path, byte_tokenizer))
    ids = IDS % len(byte_tokenizer)
    float_logits = loaded.model(ids)
    result = compile_loaded(loaded, pipeline("fp8", max_layer_error=10.0, kv_cache_dtype="float8_e4m3fn"),
                            tmp_path / "fp8")
    reloaded = load_artifact(result.path)
    assert sum(isinstance(m, Fp8Linear) for m in reloaded.model.modules()) == 7 * loaded.model.config.n_layers
    got = reloaded.model(ids)
    assert torch.equal(got, loaded.model(ids))
    err = ((got - float_logits).norm() / float_logits.norm()).item()
    assert err < 0.3, f"fp8 {case}: relative error {err:.3f}"
    prompt = ids[0, :9].tolist()
    want = reloaded.model.generate(torch.tensor([prompt]), 8)[0, 9:].tolist()
    engine = Engine.from_loaded(reloaded, "cpu", block_size=4, num_blocks=16)
    assert engine.cache.spec.dtype == torch.float8_e4m3fn
    assert engine.generate(prompt_token_ids=prompt, max_tokens=8, ignore_eos=True).token_ids == want


def test_awq_refuses_an_architecture_it_has_no_scaling_groups_for(tmp_path, monkeypatch):
    """An architecture the decoder knows but ``awq_mappings.SMOOTHING`` does not: one line at validate time."""
    from passes.awq_mappings import SMOOTHING

    config = load_checkpoint(saved("qwen3", tmp_path), with_tokenizer=False).model.config
    monkeypatch.delitem(SMOOTHING, config.architecture)
    with pytest.raises(PipelineValidationError, match=f"awq has no scaling groups for {config.architecture}") as e:
        Pipeline(pipeline("awq")).validate(config)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["deepseek-v3", "deepseek-v3-q-proj-yarn"])
def test_onnx_export_refuses_what_it_cannot_lower(case, tmp_path):
    """Multi-head latent attention is not in the ONNX graph (Qwen3, Gemma 3 and the other MoE models
    are: tests/backends/onnx/test_onnx_architectures.py)."""
    model = load_checkpoint(saved(case, tmp_path), with_tokenizer=False).model
    with pytest.raises(ConfigError, match=f"the ONNX export cannot lower {model.config.architecture}") as info:
        export_graphs(model, OnnxExportOptions(max_len=64))
    assert "\n" not in str(info.value)


def test_vllm_export_refuses_deepseek_before_writing(tmp_path, byte_tokenizer):
    loaded = load_checkpoint(saved("deepseek-v3", tmp_path, byte_tokenizer))
    out = save_artifact(tmp_path / "artifact", loaded.model, loaded.tokenizer, SourceInfo("x", "hf", "0" * 64), {}, [])
    with pytest.raises(ConfigError, match="target 'vllm' cannot run DeepseekV3ForCausalLM: vLLM 0.32's CPU build runs MLA only") as info:
        lower(out, "vllm", tmp_path / "vllm")
    assert "\n" not in str(info.value) and not (tmp_path / "vllm").exists()


def hf_config(case, **changes) -> dict:
    """The case's config.json as transformers writes it, with ``changes``."""
    return {**json.loads(make_arch_model(case).config.to_json_string()), **changes}


@pytest.mark.parametrize("case, changes, match", [
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "unsupported rope scaling 'yarn'"),
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ("qwen3", {"hidden_act": "gelu"}, "Qwen3ForCausalLM with activation 'gelu' is not supported"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    ("gemma3", {"architectures": ["Gemma3ForConditionalGeneration"]}, "Gemma3ForConditionalGeneration .* not supported"),
    ("gemma3", {"layer_types": ["sliding_attention"]}, "layer_types must give"),
    ("qwen3-moe", {"num_experts_per_tok": 9}, "num_experts_per_tok <= num_experts"),
    ("qwen3-moe", {"shared_expert_intermediate_size": 16}, "shared experts is not supported"),
    ("mixtral", {"architectures": ["DeepseekV2ForCausalLM"]}, "unsupported architecture 'DeepseekV2ForCausalLM'"),
    ("deepseek-v3", {"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
    ("deepseek-v3", {"quantization_config": {"quant_method": "fp8"}}, "quantized with 'fp8' is not supported"),
    ("deepseek-v3", {"n_group": 3}, "must split into n_group=3 groups"),
    ("deepseek-v3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "unsupported rope scaling 'longrope'"),
])
def test_unsupported_config_features_are_one_line_errors(case, changes, match):
    with pytest.raises(CheckpointError, match=match) as info:
        ModelConfig.from_hf(hf_config(case, **changes))
    assert "\n" not in str(info.value)
