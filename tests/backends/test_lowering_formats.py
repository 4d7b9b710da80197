"""Every lowering reads every format the manifest declares: the FP8 and INT8 KV caches are lowered
exactly by ONNX (quantize-dequantize of K/V in the graphs, bitwise the torch rounding); FP8 is
refused by Ascend before anything is written, and both are run by the engine behind Triton; an INT8
one is refused in one line by vLLM and GGUF (Ascend's C8: tests/backends/ascend/test_ascend_v1.py);
a serving plan is honoured or refused; a manifest entry a lowering does not know is refused by every
target."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from artifact_helpers import read_raw_manifest, rewrite_manifest
from onnx import TensorProto, helper
from onnx_helpers import rel_error

import backends  # noqa: F401  (registers the targets and their lowerings)
import passes  # noqa: F401  (registers the fp8 and paged_kv passes)
from backends.onnx.bundle import OnnxBundleInfo
from backends.onnx.export import OnnxExportOptions, export_onnx
from backends.onnx.graph import OPSET, GraphBuilder
from backends.onnx.kv_rounding import fp8_round_trip, int8_round_trip
from backends.onnx.runner import OnnxRunner
from backends.triton.lower import lower_triton
from compiler.deploy.lowering import lower
from compiler.errors import ConfigError, PipelineValidationError
from compiler.formats.kv_quant import Fp8KVQuant, Int8KVQuant
from compiler.io.artifact import load_artifact
from compiler.model.kv_cache import ContiguousKVCache
from compiler.pipeline import PipelineConfig
from compiler.pipeline.compile import compile_model
from compiler.quant.fp8 import FP8_DTYPES

CALIB = {"corpus": "pydoc", "samples": 4, "seq_len": 64, "seed": 0}
MAX_LEN = 64
BOUND = 1e-4  # ONNX Runtime against torch, float32 (the float-KV graph is > 30x further off)


def compile_with(src, out, *passes_):
    return compile_model(src, PipelineConfig.from_dict({"calibration": CALIB, "passes": list(passes_)}), out).path


def kv_pass(dtype="float8_e4m3fn", granularity="per_head", **more):
    return {"name": "fp8", "convert_linears": False, "kv_cache_dtype": dtype, "kv_cache_granularity": granularity, **more}


# -- the FP8 grid in ONNX, value by value -----------------------------------------------------
def run_round_trip(x: torch.Tensor, scale: torch.Tensor, dtype_name: str, graph_dtype: str) -> np.ndarray:
    import onnxruntime as ort

    b = GraphBuilder(graph_dtype)
    if dtype_name == "int8":
        out = int8_round_trip(b, "x", scale, 1 / scale, x.shape[1], "scale", "/kv")
    else:
        out = fp8_round_trip(b, "x", scale, dtype_name, "scale", "/kv")
    b.nodes.append(helper.make_node("Identity", [out], ["y"]))
    elem = TensorProto.FLOAT if graph_dtype == "float32" else TensorProto.FLOAT16
    graph = helper.make_graph(b.nodes, "fp8_round_trip", [helper.make_tensor_value_info("x", elem, list(x.shape))],
                              [helper.make_tensor_value_info("y", elem, list(x.shape))],
                              initializer=list(b.weights.values()) + b.consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x.numpy()})[0]


def grid_and_ties(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, and every midpoint between neighbours (the ties), both signs."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = codes[torch.isfinite(codes)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    return torch.cat([grid, mids, -mids])


@pytest.mark.parametrize("graph_dtype", ["float32", "float16"])
@pytest.mark.parametrize("dtype_name", list(FP8_DTYPES))
def test_fp8_round_trip_is_the_torch_rounding_bitwise(dtype_name, graph_dtype):
    dtype = FP8_DTYPES[dtype_name]
    g = torch.Generator().manual_seed(len(dtype_name) + len(graph_dtype))
    torch_dtype = torch.float32 if graph_dtype == "float32" else torch.float16
    # fresh values over 12 orders of magnitude (subnormals, saturation), zeros; 3 heads
    x = torch.randn(2, 3, 40, 16, generator=g) * torch.logspace(-6, 6, 16)
    x[0, :, 0] = 0
    x = x.to(torch_dtype)
    scale = torch.rand(3, generator=g) + 0.05
    want = Fp8KVQuant(dtype_name, scale, scale)(x, x)[0]
    got = run_round_trip(x, scale, dtype_name, graph_dtype)
    assert np.array_equal(got, want.numpy()), f"{int((got != want.numpy()).sum())} of {x.numel()} values differ"
    # every grid value and every tie between two (round half to even), with a power-of-two scale so
    # that x / scale is exact; per-tensor scale
    if graph_dtype == "float32":
        ties = grid_and_ties(dtype).reshape(1, 1, -1, 1) * 0.5
        scale = torch.tensor([0.5])
        want = Fp8KVQuant(dtype_name, scale, scale)(ties, ties)[0]
        assert np.array_equal(run_round_trip(ties, scale, dtype_name, graph_dtype), want.numpy())


@pytest.mark.parametrize("graph_dtype", ["float32", "float16"])
def test_int8_round_trip_is_the_torch_rounding_bitwise(graph_dtype):
    """Fresh values (in range, beyond it: the clamp, zeros) with per-channel scales, then every tie
    x / scale = k + 1/2 (round half to even) with an exact reciprocal."""
    g = torch.Generator().manual_seed(3 + len(graph_dtype))
    torch_dtype = torch.float32 if graph_dtype == "float32" else torch.float16
    scale = (torch.rand(3 * 16, generator=g) + 0.05) / 127
    x = (torch.randn(2, 3, 40, 16, generator=g) * torch.logspace(-3, 1, 16)).to(torch_dtype)  # far past 127 codes
    x[0, :, 0] = 0
    want = Int8KVQuant(scale, scale)(x, x)[0]
    bits = np.uint32 if graph_dtype == "float32" else np.uint16
    assert np.array_equal(run_round_trip(x, scale, "int8", graph_dtype).view(bits), want.numpy().view(bits))
    assert (want.float() / scale.reshape(1, 3, 1, 16)).round().min() == -128  # the clamp was reached
    if graph_dtype == "float32":
        ties = (torch.arange(-140, 140, dtype=torch.float32) + 0.5).reshape(1, 1, -1, 1) * 0.5
        half = torch.tensor([0.5])
        want = Int8KVQuant(half, half)(ties, ties)[0]
        assert np.array_equal(run_round_trip(ties, half, "int8", graph_dtype), want.numpy())
        assert want[0, 0, 140, 0] == 0 and want[0, 0, 141, 0] == 1.0  # 0.5 and 1.5 codes: to 0 and 2 (even)


# -- FP8- and INT8-KV artifacts lowered to ONNX: parity with the torch model -----------------
def tiny_llama_source(tmp, byte_tokenizer):
    """A tiny Llama checkpoint with the byte tokenizer, in ``tmp / "hf"``."""
    from conftest import make_hf_model

    src = tmp / "hf"
    make_hf_model("llama", vocab_size=len(byte_tokenizer)).save_pretrained(src)
    byte_tokenizer.save_pretrained(src)
    return src


@pytest.fixture(scope="module")
def fp8_kv_artifacts(tmp_path_factory, byte_tokenizer):
    tmp = tmp_path_factory.mktemp("fp8kv")
    src = tiny_llama_source(tmp, byte_tokenizer)
    return {
        "e4m3-per-head": compile_with(src, tmp / "a", kv_pass()),
        "e5m2-per-tensor+fp8-weights": compile_with(
            src, tmp / "b", kv_pass("float8_e5m2", "per_tensor", convert_linears=True, activation_scheme="none",
                                    max_layer_error=10.0)),
        "e4m3-per-tensor+plan": compile_with(src, tmp / "c", kv_pass(granularity="per_tensor"),
                                             {"name": "paged_kv", "block_size": 8}),
    }


@pytest.fixture(scope="module")
def int8_kv_artifact(tmp_path_factory, byte_tokenizer):
    """INT8 W8A16 (the graphs' MatMul of its dequantized weight is the layer) with an INT8 KV cache."""
    tmp = tmp_path_factory.mktemp("int8kv")
    return compile_with(tiny_llama_source(tmp, byte_tokenizer), tmp / "a",
                        {"name": "int8", "activation_scheme": "none", "kv_cache_dtype": "int8"},
                        {"name": "paged_kv", "block_size": 8})


@pytest.fixture(params=["e4m3-per-head", "e5m2-per-tensor+fp8-weights", "e4m3-per-tensor+plan", "int8-per-channel",
                        "int8-per-channel+standard-attention"])
def kv_bundle(request, tmp_path):
    artifact = (request.getfixturevalue("int8_kv_artifact") if request.param.startswith("int8")
                else request.getfixturevalue("fp8_kv_artifacts")[request.param])
    loaded = load_artifact(artifact)
    standard = request.param.endswith("standard-attention")  # K/V [B, H, T, D], as the Ascend graphs hold them
    info = export_onnx(loaded, tmp_path / "onnx", OnnxExportOptions(max_len=MAX_LEN, fused_attention=not standard))
    return loaded, info, OnnxRunner(tmp_path / "onnx", threads=1)


def without_kv_rounding(model):
    saved = [layer.self_attn.kv_quant for layer in model.layers]
    for layer in model.layers:
        layer.self_attn.kv_quant = None
    return saved


@torch.no_grad()
def test_kv_cache_lowers_exactly_to_onnx(kv_bundle):
    """Prefill and decode against the torch model on fresh ids; float K/V (what the graphs computed
    before) are far outside the bound."""
    loaded, info, runner = kv_bundle
    model, c = loaded.model, loaded.model.config
    assert isinstance(model.layers[0].self_attn.kv_quant, (Fp8KVQuant, Int8KVQuant))
    ids = torch.randint(3, c.vocab_size, (1, 24), generator=torch.Generator().manual_seed(11))
    cache = ContiguousKVCache(c.n_layers, 1, MAX_LEN, c.n_kv_heads, c.head_dim)
    got = [runner.prefill(ids[:, :9].numpy())] + [runner.decode(ids[:, t:t + 1].numpy()) for t in range(9, 24)]
    want = [model(ids[:, :9], torch.arange(9)[None], cache)]
    want += [model(ids[:, t:t + 1], torch.tensor([[t]]), cache) for t in range(9, 24)]
    errors = [rel_error(g, w.numpy()) for g, w in zip(got, want)]
    print(f"ONNX vs torch with {loaded.manifest.kv_cache['dtype']} KV: max relative error {max(errors):.1e}")
    assert max(errors) < BOUND
    saved = without_kv_rounding(model)
    try:
        float_kv = model(ids)
    finally:
        for layer, quant in zip(model.layers, saved):
            layer.self_attn.kv_quant = quant
    assert rel_error(float_kv.numpy(), model(ids).numpy()) > 30 * BOUND  # the test can tell the two apart
    assert np.array_equal(runner.generate(ids[:, :9].numpy(), 12), model.generate(ids[:, :9], 12).numpy())


def test_bundle_reports_the_kv_cache(kv_bundle):
    loaded, info, _ = kv_bundle
    kv = {name: how for name, how in info.layers.items() if name.endswith(".kv_cache")}
    assert set(kv) == {f"layers.{i}.self_attn.kv_cache" for i in range(loaded.model.config.n_layers)}
    dtype = loaded.manifest.kv_cache["dtype"]
    assert all(how.startswith(f"K/V rounded through {dtype}") for how in kv.values())


# -- Ascend: refused before anything is written ----------------------------------------------
def test_ascend_refuses_an_fp8_kv_cache(fp8_kv_artifacts, tmp_path, monkeypatch):
    from pathlib import Path

    doubles = Path(__file__).resolve().parents[1] / "doubles"
    monkeypatch.setenv("PATH", f"{doubles}:{__import__('os').environ['PATH']}")
    monkeypatch.setenv("ATC_DOUBLE_LOG", str(tmp_path / "atc.jsonl"))
    with pytest.raises(ConfigError, match="FP8 KV cache, which the Ascend lowering does not lower") as e:
        lower(fp8_kv_artifacts["e4m3-per-head"], "ascend", tmp_path / "om", {"soc": "Ascend910B3"})
    assert "\n" not in str(e.value)
    assert not (tmp_path / "om").exists() and not (tmp_path / "atc.jsonl").exists()


def test_ascend_lowers_a_float_kv_artifact_with_a_serving_plan(tiny_checkpoint_with_tokenizer, tmp_path, monkeypatch):
    from pathlib import Path

    src, _ = tiny_checkpoint_with_tokenizer("llama")
    art = compile_with(src, tmp_path / "art", {"name": "paged_kv", "block_size": 8})
    doubles = Path(__file__).resolve().parents[1] / "doubles"
    monkeypatch.setenv("PATH", f"{doubles}:{__import__('os').environ['PATH']}")
    monkeypatch.setenv("ATC_DOUBLE_LOG", str(tmp_path / "atc.jsonl"))
    lower(art, "ascend", tmp_path / "om", {"soc": "Ascend910B3", "buckets": [16, 32], "max_len": 32})
    assert OnnxBundleInfo.read(tmp_path / "om").target == "ascend"


# -- an INT8 KV cache where a target cannot hold it: one line, before anything is written ---------
def int8_kv_entry(config) -> dict:
    scales = [[0.01 * (1 + c % 5) for c in range(config["num_key_value_heads"] * config["head_dim"])]] * 2
    return {"dtype": "int8", "granularity": "per_channel", "k_scale": scales, "v_scale": scales}


@pytest.mark.parametrize("target, says", [
    ("vllm", "an INT8 KV cache: compressed-tensors' kv_cache_scheme, which vLLM reads, is FP8 only; lower it to ascend"),
    ("gguf", r"a KV cache \(int8\) with calibrated scales: llama.cpp's KV cache types carry no scales"),
])
def test_an_int8_kv_cache_is_refused_by_vllm_and_gguf(float_artifact, tmp_path, target, says):
    manifest = read_raw_manifest(float_artifact)
    c = manifest["model_config"]
    manifest["kv_cache"] = int8_kv_entry({"num_key_value_heads": c["n_kv_heads"], "head_dim": c["head_dim"]})
    rewrite_manifest(float_artifact, manifest)
    assert isinstance(load_artifact(float_artifact).model.layers[1].self_attn.kv_quant, Int8KVQuant)
    out = tmp_path / ("out.gguf" if target == "gguf" else "out")
    with pytest.raises(ConfigError, match=says) as e:
        lower(float_artifact, target, out)
    assert "\n" not in str(e.value) and not out.exists()


def test_ascend_refuses_an_int8_kv_cache_its_c8_blocks_cannot_hold(int8_kv_artifact, tmp_path):
    with pytest.raises(ConfigError, match="an INT8 KV cache with head_dim 16: vllm-ascend's C8 cache holds K/V in "
                                          "blocks of 32 channels") as e:
        lower(int8_kv_artifact, "ascend", tmp_path / "om", {"soc": "Ascend910B3"})
    assert "\n" not in str(e.value) and not (tmp_path / "om").exists()


@pytest.mark.parametrize("target, kv_pass_, says", [
    ("vllm", {"name": "int8", "kv_cache_dtype": "int8"}, "an INT8 KV cache: compressed-tensors' kv_cache_scheme"),
    ("ascend", {"name": "int8", "kv_cache_dtype": "int8"}, "an INT8 KV cache with head_dim 16"),
    ("ascend", kv_pass(), r"a KV cache \(float8_e4m3fn\): AscendV1's one KV cache is vllm-ascend's INT8 'C8'"),
    ("gguf", kv_pass(), r"a KV cache \(float8_e4m3fn\) with calibrated scales"),
])
def test_a_pipeline_with_a_kv_cache_its_target_cannot_hold_is_refused_before_any_work(
        tiny_checkpoint_with_tokenizer, tmp_path, target, kv_pass_, says):
    src, _ = tiny_checkpoint_with_tokenizer("llama")
    config = PipelineConfig.from_dict({"calibration": CALIB, "passes": [kv_pass_], "target": {"name": target}})
    with pytest.raises(PipelineValidationError, match=says) as e:
        compile_model(src, config, tmp_path / "a")
    assert "\n" not in str(e.value) and not (tmp_path / "a").exists()


# -- Triton: the engine it serves reads both entries --------------------------------------------
def test_triton_repository_serves_the_fp8_kv_cache_and_plan(fp8_kv_artifacts, tmp_path):
    from serving.engine import Engine

    art = fp8_kv_artifacts["e4m3-per-tensor+plan"]
    model_dir = lower_triton(art, tmp_path / "repo")
    manifest = read_raw_manifest(art)
    served = Engine.from_artifact(model_dir / "1" / "artifact", "cpu")  # what serving/triton_backend.py builds
    assert served.cache.spec.dtype == FP8_DTYPES[manifest["kv_cache"]["dtype"]]
    assert served.cache.spec.block_size == manifest["serving"]["block_size"] == 8
    assert served.cache.spec.num_blocks == manifest["serving"]["num_blocks"]
    # the artifact's FP8 K/V rounding: in the model as loaded, and in the served engine its cache's
    # (which stores the same codes with the same scales, so the engine drops the model's hook)
    assert isinstance(load_artifact(model_dir / "1" / "artifact").model.layers[0].self_attn.kv_quant, Fp8KVQuant)
    assert served.cache.k_scales is not None and served.model.layers[0].self_attn.kv_quant is None
    ids = [5, 9, 14, 33, 2]
    got = served.generate(prompt_token_ids=ids, max_tokens=6, ignore_eos=True).token_ids
    assert got == Engine.from_artifact(art, "cpu").generate(prompt_token_ids=ids, max_tokens=6, ignore_eos=True).token_ids


@torch.no_grad()
def test_triton_repository_serves_the_int8_kv_cache(int8_kv_artifact, tmp_path):
    """The served engine stores the artifact's INT8 K/V codes (the model's rounding hook dropped: its
    cache quantizes as the hook does): the tokens of the model as loaded, hook and all."""
    from serving.engine import Engine

    model_dir = lower_triton(int8_kv_artifact, tmp_path / "repo")
    served = Engine.from_artifact(model_dir / "1" / "artifact", "cpu")  # what serving/triton_backend.py builds
    assert served.cache.spec.dtype == torch.int8 and served.cache.spec.block_size == 8
    assert served.model.layers[0].self_attn.kv_quant is None
    model = load_artifact(int8_kv_artifact).model
    assert isinstance(model.layers[0].self_attn.kv_quant, Int8KVQuant)
    ids = [5, 9, 14, 33, 2]
    got = served.generate(prompt_token_ids=ids, max_tokens=6, ignore_eos=True).token_ids
    assert got == model.generate(torch.tensor([ids]), 6)[0, len(ids):].tolist()


# -- entries a lowering does not know, and serving plans it cannot honour -----------------------
@pytest.fixture
def float_artifact(tiny_checkpoint_with_tokenizer, tmp_path):
    src, _ = tiny_checkpoint_with_tokenizer("llama")
    return compile_with(src, tmp_path / "art", {"name": "paged_kv", "block_size": 8})


@pytest.mark.parametrize("target, options", [("onnx", {}), ("ascend", {"soc": "Ascend910B3"}), ("triton", {}),
                                             ("vllm", {}), ("gguf", {})])
def test_every_target_refuses_an_entry_it_does_not_know(float_artifact, tmp_path, target, options):
    """A future pass's entry (here a planted ``sparsity``) must not be dropped silently."""
    manifest = read_raw_manifest(float_artifact)
    manifest["sparsity"] = {"pattern": "2:4", "layers": ["layers.0.mlp.up_proj"]}
    rewrite_manifest(float_artifact, manifest)
    with pytest.raises(ConfigError, match=f"declares 'sparsity', which the {target} lowering does not know") as e:
        lower(float_artifact, target, tmp_path / "out", options)
    assert "\n" not in str(e.value) and str(float_artifact.resolve().name) in str(e.value)
    assert not (tmp_path / "out").exists()


def test_onnx_refuses_a_serving_plan_kv_dtype_its_cache_does_not_hold(float_artifact, tmp_path):
    manifest = read_raw_manifest(float_artifact)
    manifest["serving"]["kv_dtype"] = "float16"  # the engine would round K/V to float16; the bundle holds float32
    rewrite_manifest(float_artifact, manifest)
    with pytest.raises(ConfigError, match="serving plan stores K/V as float16, which the onnx bundle's cache does not"):
        lower(float_artifact, "onnx", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_vllm_refuses_a_serving_plan_kv_dtype_its_cache_does_not_hold(float_artifact, tmp_path, kv_dtype):
    """vLLM keeps K/V in the model dtype (or FP8): a plan rounding them to another dtype is not dropped."""
    manifest = read_raw_manifest(float_artifact)
    manifest["serving"]["kv_dtype"] = kv_dtype
    rewrite_manifest(float_artifact, manifest)
    with pytest.raises(ConfigError, match=f"serving plan that stores K/V as {kv_dtype} in a float32 model") as e:
        lower(float_artifact, "vllm", tmp_path / "out")
    assert "\n" not in str(e.value) and 'kv_dtype = "auto"' in str(e.value)
    assert not (tmp_path / "out").exists()


def test_vllm_exports_a_float_artifact_with_a_serving_plan(float_artifact, tmp_path):
    """The plan's KV dtype is the model's; its paging settings are vLLM's own to choose, and recorded."""
    import json

    from backends.vllm.export import EXPORT_FILE

    out = lower(float_artifact, "vllm", tmp_path / "out").path
    record = json.loads((out / EXPORT_FILE).read_text())
    assert record["serving"] == read_raw_manifest(float_artifact)["serving"] and record["serving"]["block_size"] == 8


def test_onnx_lowers_a_float_artifact_with_a_serving_plan(float_artifact, tmp_path):
    lower(float_artifact, "onnx", tmp_path / "out", {"max_len": 32})
    info = OnnxBundleInfo.read(tmp_path / "out")
    assert not any(name.endswith(".kv_cache") for name in info.layers)  # a float cache stays float


def test_gguf_refuses_a_serving_plan_kv_dtype_llama_cpp_cannot_hold(float_artifact, tmp_path):
    manifest = read_raw_manifest(float_artifact)
    manifest["serving"]["kv_dtype"] = "float8_e4m3fn"
    rewrite_manifest(float_artifact, manifest)
    with pytest.raises(ConfigError, match="stores K/V as float8_e4m3fn: llama.cpp's caches") as e:
        lower(float_artifact, "gguf", tmp_path / "out.gguf")
    assert "\n" not in str(e.value) and not (tmp_path / "out.gguf").exists()


def test_gguf_lowers_a_float_artifact_with_a_serving_plan(float_artifact, tmp_path):
    out = lower(float_artifact, "gguf", tmp_path / "out.gguf").path
    assert out.is_file() and out.stat().st_size > 0
