"""``qcompile lower --target vllm``: the compressed-tensors checkpoint, its config, and every refusal.

The checkpoint's tensors are unpacked here by compressed-tensors' documented bit layout (written
out independently of backends/vllm/tensors.py) and compared with the artifact's own codes, zero
points and dequantized weights; test_vllm_server.py runs compressed-tensors' own decompressor
and the real vLLM on them.
"""
from __future__ import annotations

import json

import pytest
import torch
from arch_helpers import ARCH_CASES, make_arch_model
from conftest import make_byte_tokenizer
from safetensors import safe_open
from vllm_helpers import FP8_KV, INT4, compile_for, save_checkpoint

import backends  # noqa: F401  (registers the vllm target)
from backends.vllm.export import EXPORT_FILE, _shards, hf_config, write_shards
from backends.vllm.schemes import check_experts, check_fused
from compiler.deploy.lowering import lower
from compiler.errors import ConfigError, PipelineValidationError
from compiler.formats.qlinear import quantized_modules
from compiler.io.artifact import load_artifact, read_manifest
from compiler.model.config import ModelConfig


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("vllm-export"), "llama")


@pytest.fixture(scope="module")
def int4(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    artifact = compile_for(checkpoint, INT4, root / "artifact")
    return artifact, lower(artifact, "vllm", root / "vllm").path


def read_tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out |= {k: f.get_tensor(k) for k in f.keys()}
    return out


def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' 4-bit packing undone: word j holds elements 8j..8j+7 at bits 0, 4, …, 28."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(w.shape[0], -1)


def test_int4_checkpoint_holds_the_artifacts_codes(int4):
    artifact, out = int4
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized" and q["ignore"] == ["lm_head"]
    by_group = {g["weights"]["group_size"]: g for g in q["config_groups"].values()}
    assert sorted(by_group) == [32, 64]  # g64 where it divides, the fallback 32 on down_proj (96 inputs)
    assert by_group[32]["targets"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert all(g["weights"]["symmetric"] is False and g["input_activations"] is None for g in by_group.values())
    tensors = read_tensors(out)
    model = load_artifact(artifact).model
    for name, module in quantized_modules(model).items():
        prefix = f"model.{name}."
        n, k, g = module.out_features, module.in_features, module.group_size
        packed, scale = tensors[prefix + "weight_packed"], tensors[prefix + "weight_scale"]
        assert packed.dtype == torch.int32 and packed.shape == (n, k // 8)
        assert scale.dtype == torch.float16 and torch.equal(scale, module.scales)  # the model dtype, unchanged
        assert tensors[prefix + "weight_shape"].tolist() == [n, k]
        codes, zeros = module.codes()
        assert torch.equal(unpack_rows(packed), codes.to(torch.int64))  # stored nibble = q' + 8 = our code
        zp = tensors[prefix + "weight_zero_point"]
        assert zp.shape == (-(-n // 8), k // g)
        assert torch.equal(unpack_rows(zp.t().contiguous())[:, :n].t(), zeros.to(torch.int64))
        w = ((unpack_rows(packed) - 8) - (unpack_rows(zp.t().contiguous())[:, :n].t() - 8).repeat_interleave(g, 1))
        assert torch.equal((w.float() * scale.float().repeat_interleave(g, 1)).to(scale.dtype), module.dequantized_weight())
    assert "lm_head.weight" in tensors and tensors["lm_head.weight"].dtype == torch.float16
    record = json.loads((out / "qcompile_export.json").read_text())
    assert record["schemes"]["model.layers.0.mlp.down_proj"] == "pack-quantized" and record["files"] == ["model.safetensors"]


def test_float32_int4_artifact_is_written_in_float16_with_its_own_scales(checkpoint, tmp_path):
    """vLLM runs INT4 layers in float16: a float32 artifact's scales are float16 values already, so they
    carry over unchanged; its other tensors are rounded, and the note says by how much."""
    artifact = compile_for(checkpoint, {**INT4, "model": {"dtype": "float32"}}, tmp_path / "artifact")
    out = lower(artifact, "vllm", tmp_path / "vllm").path
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    (note,) = json.loads((out / EXPORT_FILE).read_text())["notes"]
    assert note.startswith("written in float16") and float(note.rsplit("at most ", 1)[1].split()[0]) <= 2.0 ** -11
    tensors, model = read_tensors(out), load_artifact(artifact).model
    for name, module in quantized_modules(model).items():
        g, scale = module.group_size, tensors[f"model.{name}.weight_scale"]
        assert scale.dtype == torch.float16 and torch.equal(scale.float(), module.scales)
        packed, zp = tensors[f"model.{name}.weight_packed"], tensors[f"model.{name}.weight_zero_point"]
        codes = unpack_rows(packed) - unpack_rows(zp.t().contiguous())[:, :module.out_features].t().repeat_interleave(g, 1)
        # compressed-tensors' dequantization, in float32: the artifact's weight bit for bit
        assert torch.equal(codes.float() * scale.float().repeat_interleave(g, 1), module.dequantized_weight())
    state = model.state_dict()
    for key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert tensors[key].dtype == torch.float16 and torch.equal(tensors[key], state[key.removeprefix("model.")].half())


def test_int4_scales_finer_than_float16_are_refused(checkpoint, tmp_path, monkeypatch):
    """An artifact from before scales were kept to float16's precision: vLLM would round them, so it is refused."""
    import compiler.quant.int4 as int4

    monkeypatch.setattr(int4, "storage_scale", lambda scale, dtype: scale.float().clamp(min=1e-8).to(dtype))
    artifact = compile_for(checkpoint, {**INT4, "model": {"dtype": "float32"}}, tmp_path / "artifact")
    with pytest.raises(ConfigError, match="INT4 scales are finer than float16.*compile it again") as e:
        lower(artifact, "vllm", tmp_path / "vllm")
    assert "\n" not in str(e.value) and not (tmp_path / "vllm").exists()


def test_hf_config_round_trips_and_tokenizer_is_written(int4):
    artifact, out = int4
    config = json.loads((out / "config.json").read_text())
    assert ModelConfig.from_hf(config) == load_artifact(artifact).model.config
    assert config["dtype"] == "float16" and config["architectures"] == ["LlamaForCausalLM"]
    assert (out / "tokenizer.json").exists()


@pytest.mark.parametrize("overrides", [
    {"architecture": "Qwen2ForCausalLM", "qkv_bias": True, "tie_embeddings": True},
    {"architecture": "MistralForCausalLM", "sliding_window": 64},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 128}, "rope_theta": 500000.0, "max_seq_len": 512},
    {"qkv_bias": True, "o_bias": True, "mlp_bias": True, "eos_token_id": [2, 3]},
])
def test_hf_config_of_each_architecture_round_trips(overrides):
    config = ModelConfig(**{**dict(architecture="LlamaForCausalLM", vocab_size=320, dim=64, n_layers=2, n_heads=2,
                                   n_kv_heads=1, intermediate_size=96, bos_token_id=1, eos_token_id=2), **overrides})
    assert ModelConfig.from_hf(hf_config(config, "float32")) == config


def test_fp8_checkpoint_holds_the_artifacts_codes_and_kv_scales(checkpoint, tmp_path):
    artifact = compile_for(checkpoint, FP8_KV, tmp_path / "artifact")
    out = lower(artifact, "vllm", tmp_path / "vllm").path
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = q["config_groups"].values()
    assert group["format"] == q["format"] == "float-quantized"
    assert group["weights"] | {} == {**group["weights"], "type": "float", "num_bits": 8, "strategy": "channel"}
    assert group["input_activations"]["strategy"] == "token" and group["input_activations"]["dynamic"] is True
    assert q["kv_cache_scheme"]["strategy"] == "tensor" and q["kv_cache_scheme"]["type"] == "float"
    tensors = read_tensors(out)
    loaded = load_artifact(artifact)
    for name, module in quantized_modules(loaded.model).items():
        assert torch.equal(tensors[f"model.{name}.weight"].view(torch.uint8), module.weight.view(torch.uint8))
        scale = tensors[f"model.{name}.weight_scale"]
        assert scale.dtype == torch.float32 and torch.equal(scale, module.weight_scale[:, None])
    kv = loaded.manifest.kv_cache
    for i in range(2):
        assert tensors[f"model.layers.{i}.self_attn.k_scale"].tolist() == [kv["k_scale"][i]]
        assert tensors[f"model.layers.{i}.self_attn.v_scale"].tolist() == [kv["v_scale"][i]]


@pytest.mark.parametrize("activations, fmt, input_scale", [("static", "float-quantized", True),
                                                          ("none", "naive-quantized", False)])
def test_fp8_static_and_weight_only(checkpoint, tmp_path, activations, fmt, input_scale):
    pipeline = {"passes": [{"name": "fp8", "input_shift": False, "activation_scheme": activations, "max_layer_error": 10.0}]}
    out = lower(compile_for(checkpoint, pipeline, tmp_path / "artifact"), "vllm", tmp_path / "vllm").path
    (group,) = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"].values()
    assert group["format"] == fmt
    assert (group["input_activations"] is not None) == input_scale
    assert ("model.layers.0.self_attn.q_proj.input_scale" in read_tensors(out)) == input_scale


@pytest.mark.parametrize("options, inputs", [
    ({}, {"strategy": "token", "dynamic": True, "symmetric": True}),
    ({"activation_symmetric": False}, {"strategy": "token", "dynamic": True, "symmetric": False}),
    ({"activation_scheme": "static"}, {"strategy": "tensor", "dynamic": False, "symmetric": False}),
    ({"activation_scheme": "static", "activation_symmetric": True}, {"strategy": "tensor", "dynamic": False, "symmetric": True}),
])
def test_int8_w8a8_checkpoint_holds_the_artifacts_codes(checkpoint, tmp_path, options, inputs):
    pipeline = {"passes": [{"name": "int8", "smoothing_strength": 0.5, **options}]}
    artifact = compile_for(checkpoint, pipeline, tmp_path / "artifact")
    out = lower(artifact, "vllm", tmp_path / "vllm").path
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = q["config_groups"].values()
    assert group["format"] == q["format"] == "int-quantized"
    assert group["weights"] | {} == {**group["weights"], "type": "int", "num_bits": 8, "strategy": "channel",
                                     "symmetric": True}
    assert group["input_activations"] | {} == {**group["input_activations"], "type": "int", "num_bits": 8, **inputs}
    tensors = read_tensors(out)
    for name, module in quantized_modules(load_artifact(artifact).model).items():
        assert torch.equal(tensors[f"model.{name}.weight"], module.weight)
        assert torch.equal(tensors[f"model.{name}.weight_scale"], module.weight_scale[:, None])
        assert (f"model.{name}.input_scale" in tensors) == (options.get("activation_scheme") == "static")
        if module.input_zero_point is not None:
            zero_point = tensors[f"model.{name}.input_zero_point"]
            assert zero_point.dtype == torch.int8 and zero_point.tolist() == module.input_zero_point.tolist()


def test_int8_static_with_dynamic_units_is_two_config_groups(checkpoint, tmp_path):
    pipeline = {"passes": [{"name": "int8", "smoothing_strength": 0.5, "activation_scheme": "static",
                            "dynamic_fallback": 2}]}
    artifact = compile_for(checkpoint, pipeline, tmp_path / "artifact")
    out = lower(artifact, "vllm", tmp_path / "vllm").path
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["format"] == "int-quantized"
    targets = {g["input_activations"]["dynamic"]: set(g["targets"]) for g in q["config_groups"].values()}
    modules = read_manifest(artifact).modules
    assert targets[True] == {f"model.{n}" for n, m in modules.items() if m["activation_scheme"] == "dynamic"}
    assert targets[False] == {f"model.{n}" for n, m in modules.items() if m["activation_scheme"] == "static"}
    assert targets[True] and targets[False]
    tensors = read_tensors(out)
    assert all((f"{t}.input_scale" in tensors) == (t in targets[False]) for t in targets[True] | targets[False])


def test_int8_weight_only_is_pack_quantized_8_bit(checkpoint, tmp_path):
    artifact = compile_for(checkpoint, {"passes": [{"name": "int8", "activation_scheme": "none"}]}, tmp_path / "artifact")
    out = lower(artifact, "vllm", tmp_path / "vllm").path
    (group,) = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"].values()
    assert group["format"] == "pack-quantized" and group["input_activations"] is None
    assert group["weights"]["num_bits"] == 8 and group["weights"]["strategy"] == "channel"
    tensors = read_tensors(out)
    for name, module in quantized_modules(load_artifact(artifact).model).items():
        words = tensors[f"model.{name}.weight_packed"].to(torch.int64) & 0xFFFFFFFF
        codes = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1).reshape(module.out_features, -1)
        assert torch.equal(codes - 128, module.weight.to(torch.int64))  # compressed-tensors' offset-binary bytes
        assert tensors[f"model.{name}.weight_shape"].tolist() == [module.out_features, module.in_features]
    assert json.loads((out / EXPORT_FILE).read_text())["notes"] == []  # float32: the scales as they are


def test_int8_weight_only_in_bfloat16_says_how_far_its_scales_round(checkpoint, tmp_path):
    pipeline = {"model": {"dtype": "bfloat16"}, "passes": [{"name": "int8", "activation_scheme": "none"}]}
    out = lower(compile_for(checkpoint, pipeline, tmp_path / "artifact"), "vllm", tmp_path / "vllm").path
    (note,) = json.loads((out / EXPORT_FILE).read_text())["notes"]
    assert note.startswith("INT8 weight-only layers hold their scales in bfloat16 in vLLM")


def test_a_serving_plan_over_the_fp8_kv_cache_exports(checkpoint, tmp_path):
    """The plan stores K/V as the FP8 cache declares, which vLLM runs (kv_cache_scheme)."""
    pipeline = {"passes": [*FP8_KV["passes"], {"name": "paged_kv", "block_size": 16}]}
    out = lower(compile_for(checkpoint, pipeline, tmp_path / "artifact"), "vllm", tmp_path / "vllm").path
    assert json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] is not None
    assert json.loads((out / EXPORT_FILE).read_text())["serving"]["kv_dtype"] == "float8_e4m3fn"


def test_float_artifact_exports_without_quantization_config(checkpoint, tmp_path):
    out = lower(compile_for(checkpoint, {}, tmp_path / "artifact"), "vllm", tmp_path / "vllm").path
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert "model.layers.0.self_attn.q_proj.weight" in read_tensors(out)


def test_shards_and_index(tmp_path):
    tensors = {f"t{i}": torch.zeros(256, dtype=torch.float32) for i in range(5)}  # 1 KiB each
    assert [list(s) for s in _shards(tensors, 2048)] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    files = write_shards(tmp_path, tensors, 2048)
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["t4"] == files[2] and index["metadata"]["total_size"] == 5 * 1024
    assert set(read_tensors(tmp_path)) == set(tensors)


# Pipelines the vllm target refuses before any work, and the words the one-line error must hold.
REFUSED = [
    ({"model": {"dtype": "float16"}, "passes": [{"name": "awq", "group_size": 64, "group_size_policy": "pad"}]},
     'group_size_policy = "fallback"'),
    ({"model": {"dtype": "float16"}, "passes": [{"name": "awq", "group_size": 64, "modules_to_not_convert": []}]},
     "lm_head"),
    ({"model": {"dtype": "float16"}, "passes": [{"name": "awq", "group_size": 64,
                                                  "modules_to_not_convert": ["lm_head", "layers.1.self_attn.k_proj"]}]},
     "fused layer"),
    ({"passes": [{"name": "fp8"}]}, "input_shift = false"),
    ({"passes": [{"name": "fp8", "input_shift": False, "outlier_channels": 4}]}, "outlier_channels = 0"),
    ({"passes": [{"name": "fp8", "input_shift": False, "activation_group_size": 32}]}, "activation_group_size = 0"),
    ({"passes": [{"name": "fp8", "input_shift": False, "weight_dtype": "float8_e5m2"}]}, 'weight_dtype = "float8_e4m3fn"'),
    ({"passes": [{"name": "fp8", "input_shift": False, "activation_dtype": "float8_e5m2"}]}, "activation_dtype"),
    ({"passes": [{"name": "fp8", "input_shift": False, "granularity": "per_tensor"}]}, 'granularity = "per_channel"'),
    ({"passes": [{"name": "fp8", "input_shift": False, "kv_cache_dtype": "float8_e4m3fn"}]},
     'kv_cache_granularity = "per_tensor"'),
    ({"passes": [{"name": "fp8", "input_shift": False, "kv_cache_dtype": "float8_e5m2",
                  "kv_cache_granularity": "per_tensor"}]}, 'kv_cache_dtype = "float8_e4m3fn"'),
    ({"passes": [{"name": "paged_kv", "kv_dtype": "float16"}]}, 'stores K/V as float16 in a float32 model'),
]


def assert_refused_before_any_work(monkeypatch, checkpoint, pipeline: dict, out, words: str) -> None:
    """Compiling ``checkpoint`` for vllm stops with a one-line error holding ``words``, no pass run."""
    from compiler.pipeline import PASSES

    ran = []
    for cls in PASSES.values():
        monkeypatch.setattr(cls, "run", lambda self, *a, **k: ran.append(self.name))
    with pytest.raises(PipelineValidationError) as e:
        compile_for(checkpoint, pipeline, out)
    message = str(e.value)
    assert words in message and "target 'vllm' cannot run" in message and "\n" not in message
    assert ran == [] and not out.exists()


@pytest.mark.parametrize("pipeline, words", REFUSED, ids=[w for _, w in REFUSED])
def test_pipeline_for_vllm_is_refused_before_any_work(checkpoint, tmp_path, monkeypatch, pipeline, words):
    assert_refused_before_any_work(monkeypatch, checkpoint, pipeline, tmp_path / "artifact", words)


@pytest.mark.parametrize("pipeline, words", [
    ({"passes": [{"name": "fp8", "max_layer_error": 10.0}]}, "input_shift = false"),
    ({"passes": [{"name": "fp8", "input_shift": False, "kv_cache_dtype": "float8_e4m3fn", "max_layer_error": 10.0}]},
     "per_head"),
    ({"passes": [{"name": "paged_kv", "kv_dtype": "bfloat16"}]}, 'set the paged_kv pass\'s kv_dtype = "auto"'),
])
def test_lower_refuses_an_existing_artifact_before_writing(checkpoint, tmp_path, pipeline, words):
    artifact = compile_for(checkpoint, pipeline, tmp_path / "artifact", target=None)
    with pytest.raises(ConfigError, match=words):
        lower(artifact, "vllm", tmp_path / "vllm")
    assert not (tmp_path / "vllm").exists()


def test_fused_sets_must_share_one_scheme():
    int4 = {"format": "int4", "group_size": 64, "zero_point": True, "in_features": 64, "padded_in_features": 64}
    same = {f"layers.0.self_attn.{p}_proj": dict(int4, out_features=o) for p, o in (("q", 64), ("k", 32), ("v", 32))}
    assert check_fused(same) is None
    assert check_fused({**same, "layers.0.mlp.down_proj": dict(int4, group_size=32)}) is None  # not fused
    mixed = {**same, "layers.0.self_attn.v_proj": dict(int4, group_size=32, out_features=32)}
    assert "layers.0: q_proj int4 g64, k_proj int4 g64, v_proj int4 g32; vLLM runs q_proj/k_proj/v_proj" in check_fused(mixed)
    half = {"layers.3.mlp.gate_proj": int4}
    assert "layers.3: gate_proj int4 g64, up_proj float" in check_fused(half)


@pytest.mark.parametrize("case", [c for c in ARCH_CASES if not c.startswith("deepseek")])
def test_hf_config_of_the_newer_architectures_round_trips(case):
    """Qwen3, Gemma 3 (per-layer-type RoPE, query_pre_attn_scalar, soft-capping), Qwen3-MoE, Mixtral."""
    config = ModelConfig.from_hf(make_arch_model(case).config.to_dict())
    hf = hf_config(config, "float32")
    assert ModelConfig.from_hf(hf) == config
    assert hf["architectures"] == [config.architecture] and hf["model_type"] == config.spec.model_type


def test_gemma3_with_a_fractional_query_scalar_is_refused():
    config = ModelConfig.from_hf(make_arch_model("gemma3").config.to_dict())
    config.query_pre_attn_scalar = 16.5
    with pytest.raises(ConfigError, match="query_pre_attn_scalar=16.5"):
        hf_config(config, "float32")


def test_experts_of_a_layer_must_share_one_scheme():
    int4 = {"format": "int4", "group_size": 32, "zero_point": True}
    shapes = {"gate_proj": (64, 32), "up_proj": (64, 32), "down_proj": (32, 64)}  # (in, out): the shapes may differ
    experts = {f"layers.0.mlp.experts.{e}.{p}": dict(int4, in_features=k, padded_in_features=k, out_features=n)
               for e in range(2) for p, (k, n) in shapes.items()}
    every = {"layers.0.mlp.experts": sorted(experts)}
    assert check_experts(experts, every) is None
    mixed = {**experts, "layers.0.mlp.experts.1.down_proj": dict(int4, group_size=16, out_features=32)}
    assert "layers.0.mlp.experts: experts of 2 schemes (int4 g16, int4 g32)" in check_experts(mixed)
    fallback = {k: v for k, v in experts.items() if k != "layers.0.mlp.experts.1.up_proj"}
    assert check_experts(fallback) is None  # the quantized names alone do not show it
    assert "1 expert linears kept in float (layers.0.mlp.experts.1.up_proj, ...)" in check_experts(fallback, every)
    mixtral = {f"layers.2.block_sparse_moe.experts.0.{p}": dict(int4, group_size=g, out_features=32)
               for p, g in (("w1", 32), ("w3", 32), ("w2", 64))}
    assert "layers.2.block_sparse_moe.experts: experts of 2 schemes" in check_experts(mixtral)


def save_arch(root, case, **overrides):
    tokenizer = make_byte_tokenizer()
    path = root / f"ckpt-{case}"
    make_arch_model(case, vocab_size=len(tokenizer), head_dim=32, num_attention_heads=2, num_key_value_heads=1,
                    **overrides).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_fp8_experts_are_refused_and_float_experts_export(tmp_path):
    """vLLM's CPU build has no per-channel FP8 MoE kernel: refused before any work; with the experts
    kept in float the rest is FP8, and the checkpoint names the experts as HF does, the router float."""
    checkpoint = save_arch(tmp_path, "mixtral")
    with pytest.raises(PipelineValidationError) as e:
        compile_for(checkpoint, {"passes": [{"name": "fp8", "input_shift": False}]}, tmp_path / "refused")
    assert "fp8 MoE experts" in str(e.value) and "\n" not in str(e.value)
    pipeline = {"passes": [{"name": "fp8", "input_shift": False, "max_layer_error": 10.0,
                            "modules_to_not_convert": ["lm_head", "embed_tokens", "experts"]}]}
    out = lower(compile_for(checkpoint, pipeline, tmp_path / "artifact"), "vllm", tmp_path / "vllm").path
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.block_sparse_moe.gate" in q["ignore"]
    assert "model.layers.0.block_sparse_moe.experts.3.w2" in q["ignore"]
    tensors = read_tensors(out)
    assert tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"].dtype == torch.float32
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn


def test_lower_refuses_experts_left_float_beside_quantized_ones(tmp_path):
    checkpoint = save_arch(tmp_path, "qwen3-moe", moe_intermediate_size=64)
    pipeline = {"model": {"dtype": "float16"}, "passes": [{"name": "awq", "group_size": 64, "zero_point": False,
                                                            "modules_to_not_convert": ["lm_head", "experts.5"]}]}
    artifact = compile_for(checkpoint, pipeline, tmp_path / "artifact", target=None)
    with pytest.raises(ConfigError, match=r"layers.0.mlp.experts: 3 expert linears kept in float \(layers.0.mlp.experts.5"):
        lower(artifact, "vllm", tmp_path / "vllm")


def test_gemma3_with_int4_layers_is_refused_by_lower(tmp_path):
    """A float32 Gemma 3 artifact with INT4 layers would be written in float16, which vLLM refuses (a
    compile in float16 is refused for Gemma 3 before it starts: tests/compiler/pipeline)."""
    checkpoint = save_arch(tmp_path, "gemma3")
    artifact = compile_for(checkpoint, {"passes": [{"name": "awq", "group_size": 32}]}, tmp_path / "artifact", target=None)
    with pytest.raises(ConfigError, match="vLLM refuses Gemma 3 in float16"):
        lower(artifact, "vllm", tmp_path / "vllm")


@pytest.mark.parametrize("awq, words", [({"group_size": 64}, "zero_point = false"),
                                        ({"group_size": 32, "zero_point": False}, "use group_size = 64 or 128")])
def test_int4_experts_vllm_cpu_cannot_run_are_refused_before_any_work(tmp_path, awq, words):
    checkpoint = save_arch(tmp_path, "qwen3-moe", moe_intermediate_size=64)
    with pytest.raises(PipelineValidationError) as e:
        compile_for(checkpoint, {"model": {"dtype": "float16"}, "passes": [{"name": "awq", **awq}]}, tmp_path / "artifact")
    assert words in str(e.value) and "int4 MoE experts" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "artifact").exists()


def test_quantized_dense_mlp_of_qwen3_moe_is_refused(tmp_path):
    checkpoint = save_arch(tmp_path, "qwen3-moe", moe_intermediate_size=64, mlp_only_layers=[1])
    pipeline = {"model": {"dtype": "float16"}, "passes": [{"name": "awq", "group_size": 64, "zero_point": False}]}
    artifact = compile_for(checkpoint, pipeline, tmp_path / "artifact", target=None)
    with pytest.raises(ConfigError, match=r"layers.1.mlp.gate_proj: a quantized MLP in a Qwen3-MoE dense layer"):
        lower(artifact, "vllm", tmp_path / "vllm")


# What only the model's config shows, refused by a pipeline for vllm before any pass runs (and by lower).
INT4_SYMMETRIC = {"model": {"dtype": "float16"}, "passes": [{"name": "awq", "group_size": 64, "zero_point": False}]}
ARCH_REFUSED = {
    "deepseek": ("deepseek-v3", {}, {"passes": []}, "DeepseekV3ForCausalLM: vLLM 0.32's CPU build runs MLA only at"),
    "gemma3-float32-int4": ("gemma3", {}, {"passes": [{"name": "awq", "group_size": 32}]},
                            "INT4 layers are written in float16): vLLM refuses Gemma 3 in float16"),
    "qwen3-moe-dense-layer": ("qwen3-moe", {"moe_intermediate_size": 64, "mlp_only_layers": [1]}, INT4_SYMMETRIC,
                              "layers.1.mlp.gate_proj: a quantized MLP in a Qwen3-MoE dense layer"),
    "experts-left-float": ("qwen3-moe", {"moe_intermediate_size": 64},
                           {**INT4_SYMMETRIC, "passes": [{**INT4_SYMMETRIC["passes"][0],
                                                          "modules_to_not_convert": ["lm_head", "experts.5"]}]},
                           "3 expert linears kept in float"),
}


@pytest.mark.parametrize("name", list(ARCH_REFUSED))
def test_pipeline_for_vllm_refuses_what_the_model_config_shows_before_any_work(tmp_path, monkeypatch, name):
    case, overrides, pipeline, words = ARCH_REFUSED[name]
    tokenizer = make_byte_tokenizer()
    checkpoint = tmp_path / "checkpoint"
    make_arch_model(case, vocab_size=len(tokenizer), **overrides).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    assert_refused_before_any_work(monkeypatch, checkpoint, pipeline, tmp_path / "artifact", words)
