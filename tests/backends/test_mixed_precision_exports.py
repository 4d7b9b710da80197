"""A mixed INT4 / INT8 artifact (the awq pass's ``average_bits``) through every target: vLLM (one
config group per scheme), GGUF (Q4_1 and Q8_0, layer by layer), ONNX Runtime (MatMulNBits and the
INT8 layers' dequantized MatMul), Triton (the engine), Ascend (the .om from dequantized weights, no
vllm-ascend directory: vllm-ascend has no dense INT4)."""
from __future__ import annotations

import json

import gguf
import pytest
import torch
from conftest import make_hf_model
from numerics import relative_error
from onnx_helpers import rel_error
from safetensors import safe_open

import backends  # noqa: F401  (registers the targets)
import passes  # noqa: F401  (registers awq)
from backends.gguf.export import _int8_as_q8_0, check_module, file_notes
from backends.vllm.export import EXPORT_FILE
from compiler.deploy.lowering import lower
from compiler.formats.int8 import Int8Format, Int8Linear
from compiler.io.artifact import load_artifact
from compiler.io.gguf import read_gguf
from compiler.pipeline import PipelineConfig
from compiler.pipeline.compile import compile_model

# INT4 g32 in float32 is 5.125 bits per weight: 6.5 leaves room for some INT8 units, not all.
MIXED = {"calibration": {"samples": 4, "seq_len": 64},
         "passes": [{"name": "awq", "group_size": 32, "average_bits": 6.5}]}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, byte_tokenizer):
    root = tmp_path_factory.mktemp("mixed")
    make_hf_model("llama", vocab_size=len(byte_tokenizer)).save_pretrained(root / "ckpt")
    byte_tokenizer.save_pretrained(root / "ckpt")
    artifact = compile_model(root / "ckpt", PipelineConfig.from_dict(MIXED), root / "artifact").path
    loaded = load_artifact(artifact)
    formats = {n: m["format"] for n, m in loaded.manifest.modules.items()}
    assert set(formats.values()) == {"int4", "int8"}, formats
    return artifact, loaded, formats


def read_tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_vllm_writes_one_config_group_per_scheme(mixed, tmp_path):
    artifact, loaded, formats = mixed
    out = lower(artifact, "vllm", tmp_path / "vllm").path
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"].values()
    by_bits = {g["weights"]["num_bits"]: g for g in groups}
    assert len(groups) == 2 and sorted(by_bits) == [4, 8]
    assert by_bits[8]["weights"]["strategy"] == "channel" and by_bits[8]["format"] == "pack-quantized"
    for bits, fmt in ((4, "int4"), (8, "int8")):
        assert sorted(by_bits[bits]["targets"]) == sorted(f"model.{n}" for n, f in formats.items() if f == fmt)
    tensors = read_tensors(out)
    for name in (n for n, f in formats.items() if f == "int8"):
        module = loaded.model.get_submodule(name)
        words = tensors[f"model.{name}.weight_packed"].to(torch.int64) & 0xFFFFFFFF
        codes = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1).reshape(module.out_features, -1)
        assert torch.equal(codes - 128, module.weight.to(torch.int64))
        scale = tensors[f"model.{name}.weight_scale"]  # in the float16 checkpoint, exactly the artifact's
        assert scale.dtype == torch.float16 and torch.equal(scale.float().flatten(), module.weight_scale)
    assert not [n for n in json.loads((out / EXPORT_FILE).read_text())["notes"] if "INT8" in n]


def test_gguf_holds_int4_as_q4_1_and_int8_as_q8_0(mixed, tmp_path):
    artifact, loaded, formats = mixed
    out = lower(artifact, "gguf", tmp_path / "m.gguf").path
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    int8 = [n for n, f in formats.items() if f == "int8"]
    assert {types[n] for n in types if n.startswith("blk.") and n.endswith(".weight") and "norm" not in n} == {"Q4_1", "Q8_0"}
    _, tensors = read_gguf(out, torch.float32)
    for name, fmt in formats.items():
        ours = loaded.model.get_submodule(name).dequantized_weight().float()
        if fmt == "int8":  # the codes and the float16-valued scales as they are
            assert torch.equal(tensors[f"{name}.weight"], ours), name
        else:  # Q4_1's m = -s*z in float16
            assert relative_error(tensors[f"{name}.weight"], ours) < 1e-3, name
    notes = file_notes(out)
    assert not [n for n in notes if "Q8_0's d" in n] and sum("Q4_1's m" in n for n in notes) == len(formats) - len(int8)


def test_gguf_q8_0_of_other_int8_layers_says_how_far_their_scales_round():
    linear = torch.nn.Linear(64, 8, bias=False)
    module = Int8Linear.from_linear(linear, Int8Format.for_linear(linear, activation_scheme="none"))
    notes: list[str] = []
    stored = _int8_as_q8_0(module, notes, "x")
    got = torch.from_numpy(gguf.quants.dequantize(stored.data, gguf.GGMLQuantizationType.Q8_0)).float()
    moved = relative_error(got, module.dequantized_weight())
    assert 0 < moved < 1e-3 and len(notes) == 1 and notes[0].startswith("x: Q8_0's d = the row's INT8 scale")
    assert check_module("x", {"format": "int8", "activation_scheme": "none", "in_features": 64}) is None
    assert "Q8_0 blocks are 32 wide" in check_module("x", {"format": "int8", "activation_scheme": "none",
                                                           "in_features": 48})
    assert "(W8A8)" in check_module("x", {"format": "int8", "activation_scheme": "dynamic", "in_features": 64})


@torch.no_grad()
def test_onnx_runs_the_mix(mixed, tmp_path):
    """Parity with the formats' exact numerics: MatMulNBits at accuracy_level 0 against torch's reference INT4."""
    from backends.onnx.runner import OnnxRunner
    from compiler.kernels.int4_cpu import reference_only

    artifact, loaded, formats = mixed
    out = lower(artifact, "onnx", tmp_path / "onnx", {"accuracy_level": 0}).path
    layers = json.loads((out / "bundle.json").read_text())["layers"]
    assert sum("MatMulNBits" in str(v) for v in layers.values()) == sum(f == "int4" for f in formats.values())
    assert sum("dequantized int8" in str(v) for v in layers.values()) == sum(f == "int8" for f in formats.values())
    ids = torch.randint(0, loaded.model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with reference_only():
        ref = loaded.model(ids).numpy()
    assert rel_error(OnnxRunner(out, threads=1).prefill(ids.numpy()), ref) < 1e-4


def test_triton_serves_the_mix(mixed, tmp_path):
    artifact, _, _ = mixed
    assert (lower(artifact, "triton", tmp_path / "repo", {"name": "m"}).path / "config.pbtxt").exists()


def test_ascend_builds_the_om_from_dequantized_weights_without_a_vllm_ascend_directory(mixed, tmp_path, monkeypatch):
    from backends.ascend.atc import AtcNotFound, AtcOptions
    from backends.ascend.lower import lower_ascend
    from backends.ascend.msmodelslim import DIRECTORY

    _, loaded, formats = mixed
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no atc: the bundle is written, the .om is not built
    with pytest.raises(AtcNotFound):
        lower_ascend(loaded, tmp_path / "b", AtcOptions("Ascend910B3", (32, 64)), max_len=64)
    notes = json.loads((tmp_path / "b" / "bundle.json").read_text())["extras"]["notes"]
    assert f"{len(formats)} quantized layer(s) are fp16 in the .om, built from their dequantized weights" in notes
    assert any(n.startswith(f"no {DIRECTORY}/ directory: vllm-ascend runs INT4 weight-only") for n in notes)
    assert not (tmp_path / "b" / DIRECTORY).exists()
