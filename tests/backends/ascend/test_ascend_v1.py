"""The vllm-ascend directory (msModelSlim's AscendV1 layout) that ``qcompile lower --target ascend`` writes.

vllm-ascend cannot be imported here: its wheel (0.23.0, the PyPI release) needs torch_npu and vLLM
0.23, and this project's vLLM is 0.32, so its modules fail at import (``FusedMoE`` moved) before any
NPU call. These tests therefore mirror its checks, from these files of vllm-ascend 0.23.0 (the
wheel; identical in what is mirrored here to main at 182b75ea):

* ``vllm_ascend/quantization/modelslim_config.py``: ``MODELSLIM_CONFIG_FILENAME``,
  ``get_linear_quant_type`` (a layer's type is ``description["<prefix>.weight"]``; a fused layer's
  shards must agree) and ``AscendModelSlimConfig.is_layer_skipped_ascend`` (FLOAT), mirrored in
  ``vllm_ascend_layer_type``;
* ``vllm_ascend/quantization/methods/w8a8_static.py`` (``AscendW8A8LinearMethod.get_weight``,
  ``get_pertensor_param``, ``get_perchannel_param``, ``apply``: ``npu_quantize`` by the reciprocal
  of the input scale plus the offset, then ``npu_quant_matmul(x, weight, deq_scale, bias=quant_bias)``),
  ``w8a8_dynamic.py`` (``AscendW8A8DynamicLinearMethod``: ``npu_dynamic_quant`` per token, then
  ``npu_quant_matmul(..., weight_scale, pertoken_scale, bias)``) and ``w8a16.py``
  (``AscendW8A16LinearMethod``: ``npu_weight_quant_batchmatmul`` with antiquant scale and offset),
  mirrored in ``VLLM_ASCEND_PARAMS`` and the ``npu_*`` functions below;
* ``vllm_ascend/quantization/utils.py``: ``detect_quantization_method`` (the description file present);

and, for the INT8 KV cache ("C8"), vllm-ascend main at 182b75ea (not checked against the 0.23.0
wheel), whose ``modelslim_config.py`` imports vLLM and ``vllm_ascend/utils.py`` torch_npu at the top:
``modelslim_config.py`` (``AscendModelSlimConfig._add_kvcache_quant_metadata``,
``get_cache_scale_mapper``, ``is_c8_quant_layer``), ``methods/kv_c8.py``
(``AscendC8KVCacheAttentionMethod.create_weights`` / ``process_weights_after_loading``,
``_c8_kv_scale_weight_loader``) and ``attention/attention_v1.py`` (``AscendC8AttentionBackendImpl``:
``_prepare_c8_scales``, ``_quantize_kv_to_int8``, ``_dequant_paged_kv_to_dense``), mirrored in the
``c8_*`` and ``npu_c8_*`` functions below;

and msModelSlim's AscendV1 saver (``msmodelslim/core/quant_service/modelslim_v1/save/ascendv1.py``,
``save/utils/deqscale.py``, Ascend/msmodelslim at 030d6ea4) for deq_scale, quant_bias and the int64
packing of deq_scale (float32 bits, sign-extended from int32), and its ``on_dynamic_cache`` for the C8
description (``kv_cache_type`` and ``kv_quant_type`` "C8", each tensor typed "C8").
"""
from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_hf_model
from paged_helpers import int8_kv_entry

from backends.ascend.atc import AtcNotFound, AtcOptions, build_script
from backends.ascend.lower import lower_ascend
from backends.ascend.msmodelslim import (
    DESCRIPTION_FILE,
    DIRECTORY,
    INDEX_FILE,
    WEIGHTS_FILE,
    check_ascend_v1,
    read_ascend_v1,
    write_weights,
)
from compiler.errors import ConfigError
from compiler.formats.fp8 import Fp8Format, Fp8Linear
from compiler.formats.int4 import Int4Linear
from compiler.formats.int8 import Int8Format, Int8Linear
from compiler.formats.kv_quant import Int8KVQuant
from compiler.formats.qlinear import linear_modules, quantized_modules
from compiler.io.artifact import load_artifact, save_artifact
from compiler.io.load import load_checkpoint
from compiler.io.types import LoadedModel, SourceInfo

OPTS = AtcOptions("Ascend910B3", (32, 64))
INPUT_SCALE = 2.0 ** -5  # a power of two: float16 / bfloat16 hold it, and x * (1 / s) == x / s exactly

# The parameters vllm-ascend creates per scheme (name -> (shape, dtype)), dt the model dtype: the
# get_weight / get_pertensor_param / get_perchannel_param of methods/w8a8_static.py, w8a8_dynamic.py, w8a16.py.
def vllm_ascend_params(kind: str, n: int, k: int, dt: torch.dtype) -> dict[str, tuple[tuple, torch.dtype]]:
    common = {"weight": ((n, k), torch.int8), "weight_scale": ((n, 1), dt), "weight_offset": ((n, 1), dt)}
    if kind == "W8A8":
        deq = torch.float32 if dt == torch.bfloat16 else torch.int64  # only these two dtypes get a deq_scale
        return common | {"input_scale": ((1,), dt), "input_offset": ((1,), torch.int8),
                         "quant_bias": ((n,), torch.int32), "deq_scale": ((n,), deq)}
    assert kind in ("W8A8_DYNAMIC", "W8A16")
    return common


# Linear schemes vllm-ascend 0.23.0 registers (methods/*.py register_scheme(..., "linear")).
LINEAR_SCHEMES = {"W8A8", "W8A8_DYNAMIC", "W8A16", "W8A8_MIX", "W4A4_DYNAMIC", "W4A8_DYNAMIC", "W4A4_FLATQUANT_DYNAMIC",
                  "W4A4_MXFP4", "W4A4_MXFP4_FLATQUANT", "W4A8_MXFP", "W8A8_MXFP8", "W8A8FP8_DYNAMIC"}
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}  # vLLM's Llama mapping


def vllm_ascend_layer_type(description: dict, prefix: str) -> str:
    """modelslim_config.py: is_layer_skipped_ascend, then get_linear_quant_type (KeyError / ValueError as there)."""
    proj = prefix.split(".")[-1]
    if proj in PACKED:
        types = {description[prefix.replace(proj, shard) + ".weight"] for shard in PACKED[proj]}
        if len(types) > 1:
            raise ValueError(f"Not all shards of {prefix} are quantized with same quant type")
        kind = types.pop()
    else:
        if any(k.startswith(prefix) and k.endswith(".weight") and v == "FLOAT" for k, v in description.items()):
            return "FLOAT"
        kind = description[prefix + ".weight"]
    assert kind == "FLOAT" or kind in LINEAR_SCHEMES, kind
    return kind


def vllm_prefixes(n_layers: int) -> list[str]:
    """The prefixes vLLM's Llama/Qwen2 ask the quantization config about (linear and embedding layers)."""
    out = ["model.embed_tokens", "lm_head"]
    for i in range(n_layers):
        out += [f"model.layers.{i}.self_attn.qkv_proj", f"model.layers.{i}.self_attn.o_proj",
                f"model.layers.{i}.mlp.gate_up_proj", f"model.layers.{i}.mlp.down_proj"]
    return out


def deq_scale_float(t: torch.Tensor) -> torch.Tensor:
    """The float32 a deq_scale parameter stands for (int64: msModelSlim's deqscale2int64, undone)."""
    if t.dtype == torch.int64:
        return torch.from_numpy(t.numpy().astype(np.int32).view(np.float32).copy())
    return t.float()


# -- what the NPU computes from the exported tensors (the vllm-ascend scheme's apply) -------------
def npu_w8a8_static(x: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """npu_quantize(x, 1 / input_scale, input_offset, qint8) then npu_quant_matmul with deq_scale and
    quant_bias: (q @ weight.T + quant_bias) * deq_scale, in float32 (before the output dtype)."""
    recip = (1 / t["input_scale"]).to(t["input_scale"].dtype)  # process_weights_after_loading
    q = torch.round(x.float() * recip.float() + t["input_offset"].float()).clamp(-128, 127).to(torch.int8)
    acc = torch._int_mm(q, t["weight"].t().contiguous())
    return (acc + t["quant_bias"]).float() * deq_scale_float(t["deq_scale"])


def npu_w8a8_dynamic(x: torch.Tensor, t: dict[str, torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    """npu_dynamic_quant (symmetric per token) then npu_quant_matmul(q, weight, weight_scale, pertoken_scale, bias)."""
    scale = x.float().abs().amax(dim=1, keepdim=True) / 127
    q = torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)
    y = torch._int_mm(q, t["weight"].t().contiguous()).float() * scale * t["weight_scale"].float().reshape(1, -1)
    return y if bias is None else y + bias.float()


def npu_w8a16_weight(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """npu_weight_quant_batchmatmul's antiquant: w = (weight + antiquant_offset) * antiquant_scale, in the model dtype."""
    dt = t["weight_scale"].dtype
    return (t["weight"].to(dt) + t["weight_offset"]) * t["weight_scale"]


def npu_w8a16(x: torch.Tensor, t: dict[str, torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    """x @ the antiquantized weight (accumulated in float32 here) + bias."""
    y = x.float() @ npu_w8a16_weight(t).float().t()
    return y if bias is None else y + bias.float()


# -- artifacts ---------------------------------------------------------------------------------
def int8_artifact(tmp_path: Path, arch: str = "llama", dtype: str = "bfloat16", scheme="dynamic",
                  symmetric: bool | Callable[[str], bool] = True, zero_point: int = 7, tokenizer=None, tweak=None,
                  kv_cache: bool = False, **overrides) -> Path:
    """A tiny model with every linear but lm_head INT8 (``scheme`` and ``symmetric`` may be functions of
    the layer name); ``kv_cache``: with an INT8 KV cache calibrated on the quantized model's K/V (as the
    int8 pass does)."""
    hf_dir = tmp_path / f"hf-{arch}"
    make_hf_model(arch, **overrides).save_pretrained(hf_dir)
    loaded = load_checkpoint(hf_dir, dtype=dtype, with_tokenizer=False)
    for name, linear in linear_modules(loaded.model).items():
        if name == "lm_head":
            continue
        kind = scheme(name) if callable(scheme) else scheme
        if linear.bias is not None:  # transformers starts biases at 0: make them count
            with torch.no_grad():
                linear.bias.copy_(torch.randn(linear.bias.shape, generator=torch.Generator().manual_seed(len(name))))
        if kind == "float":
            continue
        sym = (symmetric(name) if callable(symmetric) else symmetric) if kind != "none" else True
        fmt = Int8Format.for_linear(linear, activation_scheme=kind, activation_symmetric=sym)
        qparams = (INPUT_SCALE, None if sym else zero_point) if kind == "static" else None
        loaded.model.set_submodule(name, Int8Linear.from_linear(linear, fmt, input_qparams=qparams))
    if tweak:
        tweak(loaded.model)
    extras = {"kv_cache": int8_kv_entry(loaded.model)} if kv_cache else {}
    out = tmp_path / f"artifact-{arch}-{dtype}"
    return save_artifact(out, loaded.model, tokenizer, SourceInfo(str(hf_dir), "hf", "0" * 64), {}, [], extras)



def lower(artifact: Path, out: Path, monkeypatch) -> tuple[dict, dict, dict]:
    """Lower without ATC here (the bundle is written, AtcNotFound); (description, tensors, bundle.json)."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with pytest.raises(AtcNotFound):
        lower_ascend(load_artifact(artifact), out, OPTS, max_len=64)
    description, tensors = read_ascend_v1(out / DIRECTORY)
    return description, tensors, json.loads((out / "bundle.json").read_text())


SCHEMES = [("dynamic", True, "W8A8_DYNAMIC"), ("static", True, "W8A8"), ("static", False, "W8A8"), ("none", True, "W8A16")]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("scheme,symmetric,kind", SCHEMES)
def test_layout_per_scheme_is_what_vllm_ascend_creates(tmp_path, monkeypatch, dtype, scheme, symmetric, kind):
    artifact = int8_artifact(tmp_path, "qwen2", dtype, scheme, symmetric)  # qwen2: q/k/v have a bias
    description, tensors, bundle = lower(artifact, tmp_path / "b", monkeypatch)
    loaded = load_artifact(artifact)
    dt = getattr(torch, dtype)
    d = tmp_path / "b" / DIRECTORY
    assert (d / DESCRIPTION_FILE).exists() and (d / WEIGHTS_FILE).exists()
    config = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["dtype"] == dtype
    assert description["version"] == "1.0.0" and description["model_quant_type"] == kind
    assert {"metadata", "group_size", "optional"} <= set(description)
    int8 = quantized_modules(loaded.model)
    assert int8 and all(isinstance(m, Int8Linear) for m in int8.values())
    for name, m in int8.items():
        prefix = f"model.{name}"
        want = vllm_ascend_params(kind, m.out_features, m.in_features, dt)
        got = {k.removeprefix(prefix + "."): v for k, v in tensors.items() if k.startswith(prefix + ".")}
        assert set(got) == set(want) | ({"bias"} if m.bias is not None else set()), name
        for leaf, (shape, want_dtype) in want.items():
            assert tuple(got[leaf].shape) == shape and got[leaf].dtype == want_dtype, (name, leaf)
            assert description[f"{prefix}.{leaf}"] == kind
        if m.bias is not None:
            assert description[f"{prefix}.bias"] == "FLOAT" and got["bias"].dtype == dt
            assert torch.equal(got["bias"], m.bias)
        assert torch.equal(got["weight"], m.weight)  # the artifact's codes, never re-quantized
        assert torch.equal(got["weight_scale"], m.weight_scale.to(dt).reshape(-1, 1))
        assert not got["weight_offset"].any()
        if kind == "W8A8":
            assert int(got["input_offset"]) == (0 if symmetric else 7)
            assert torch.equal(deq_scale_float(got["deq_scale"]), INPUT_SCALE * m.weight_scale)
    # every layer vLLM builds finds its type, fused layers agree, and the rest is FLOAT
    for prefix in vllm_prefixes(loaded.model.config.n_layers):
        want = "FLOAT" if prefix in ("model.embed_tokens", "lm_head") else kind
        assert vllm_ascend_layer_type(description, prefix) == want, prefix
    for name, t in loaded.model.state_dict().items():
        if name.rpartition(".")[0] not in int8 and name != "lm_head.weight":
            hf = name if name.startswith("lm_head") else f"model.{name}"
            assert description[hf] == "FLOAT" and torch.equal(tensors[hf], t), hf
    assert set(description) - {"version", "model_quant_type", "metadata", "group_size", "optional"} == set(tensors)
    assert any(n.startswith(f"{DIRECTORY}/: the artifact in msModelSlim's AscendV1 layout ({kind})")
               for n in bundle["extras"]["notes"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_w8a8_static_npu_arithmetic_is_the_artifacts(tmp_path, monkeypatch, dtype, symmetric):
    """What npu_quantize + npu_quant_matmul compute from the exported tensors is reference_forward:
    bit for bit without a bias, within half a deq_scale step where msModelSlim folds a float bias."""
    artifact = int8_artifact(tmp_path, "qwen2", dtype, "static", symmetric)
    _, tensors, bundle = lower(artifact, tmp_path / "b", monkeypatch)
    gen = torch.Generator().manual_seed(0)
    for name, m in quantized_modules(load_artifact(artifact).model).items():
        t = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.rpartition(".")[0] == f"model.{name}"}
        # x / s = k ± 1/4: inside the calibrated range and never half-way (where the NPU's rounding of
        # x / s + z and the artifact's of x / s differ with an odd z; the notes say so), exact in dtype
        k = torch.randint(-60, 60, (9, m.in_features), generator=gen).float()
        x = ((k + 0.25 * torch.sign(torch.randn(k.shape, generator=gen))) * INPUT_SCALE).to(getattr(torch, dtype)).float()
        assert torch.equal(x / INPUT_SCALE, torch.round(x / INPUT_SCALE * 4) / 4)
        ref = m.reference_forward(x)
        got = npu_w8a8_static(x, t)
        if m.bias is None:
            assert torch.equal(got, ref), name
        else:
            step = deq_scale_float(t["deq_scale"])
            assert ((got - ref).abs() <= 0.5 * step + 1e-6 * ref.abs()).all(), name
            assert not torch.equal(got, ref)  # the folded bias is rounded, and the note says so
    notes = bundle["extras"]["notes"]
    assert any("folds each float bias into quant_bias" in n for n in notes)
    assert any("clamps codes to -128..127" in n for n in notes) == symmetric
    assert any("rounds x / s + z at once" in n for n in notes) == (not symmetric)
    assert not any("static input scales" in n for n in notes)  # a power of two: held exactly, reciprocal too


def test_static_input_scale_rounding_is_reported(tmp_path, monkeypatch):
    """vllm-ascend holds the input scale in the model dtype and quantizes by its reciprocal in that dtype."""
    def odd_scale(model):
        for m in quantized_modules(model).values():
            m.input_scale.fill_(0.0123)

    artifact = int8_artifact(tmp_path, "llama", "bfloat16", "static", tweak=odd_scale)
    _, tensors, bundle = lower(artifact, tmp_path / "b", monkeypatch)
    s = torch.tensor([0.0123])
    stored = tensors["model.layers.0.self_attn.q_proj.input_scale"]
    assert stored.dtype == torch.bfloat16 and torch.equal(stored, s.to(torch.bfloat16))
    effective = float(1 / (1 / stored).to(torch.bfloat16).float())
    notes = {n.split(" in bfloat16")[0]: float(n.split("up to ")[1].split(" ")[0]) for n in bundle["extras"]["notes"]
             if "static input scales" in n}
    assert notes["vllm-ascend holds static input scales (as the reciprocal it quantizes by)"] == pytest.approx(
        abs(effective - 0.0123) / 0.0123, rel=0.05)
    assert notes["vllm-ascend holds static input scales"] == pytest.approx(abs(float(stored) - 0.0123) / 0.0123, rel=0.05)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_w8a8_dynamic_and_w8a16_npu_arithmetic_is_the_artifacts(tmp_path, monkeypatch, dtype):
    """The codes and integer sums are the artifact's; the change is vllm-ascend's weight scale in the
    model dtype, by at most the relative change the notes report (and float32 rounding of the scaling,
    whose order in npu_quant_matmul is not known here)."""
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(1)
    for scheme in ("dynamic", "none"):
        artifact = int8_artifact(tmp_path / scheme, "qwen2", dtype, scheme)
        _, tensors, bundle = lower(artifact, tmp_path / scheme / "b", monkeypatch)
        notes = [n for n in bundle["extras"]["notes"] if "INT8 weight scales" in n]
        assert len(notes) == 1, bundle["extras"]["notes"]
        rel = float(notes[0].split("up to ")[1].split(" ")[0])
        assert 0 < rel <= (2 ** -8 if dt == torch.bfloat16 else 2 ** -10)
        for name, m in quantized_modules(load_artifact(artifact).model).items():
            t = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.rpartition(".")[0] == f"model.{name}"}
            x = torch.randn(5, m.in_features, generator=gen).to(dt).float()
            if scheme == "dynamic":
                got, ref = npu_w8a8_dynamic(x, t, m.bias), m.reference_forward(x)
                exact = npu_w8a8_dynamic(x, {**t, "weight_scale": m.weight_scale}, m.bias)
                # with the artifact's float32 scales: the same codes and sums, the scaling within float32 rounding
                torch.testing.assert_close(exact, ref, rtol=1e-6, atol=1e-6)
                bias = 0 if m.bias is None else m.bias.float()
                assert ((got - ref).abs() <= (ref - bias).abs() * rel * 1.01 + 1e-6).all(), name
            else:
                # the weight npu_weight_quant_batchmatmul multiplies by, against the artifact's float32 one:
                # its scale rounded (≤ rel) and the product rounded to dt (≤ eps / 2)
                w_npu, w_art = npu_w8a16_weight(t), m.dequantized_weight()
                assert ((w_npu.float() - w_art).abs() <= w_art.abs() * (rel + torch.finfo(dt).eps / 2) * 1.01).all()
                got = npu_w8a16(x, t, m.bias)
                ref = x @ w_art.t() + (0 if m.bias is None else m.bias.float())
                torch.testing.assert_close(got, ref, rtol=0, atol=2 * (rel + torch.finfo(dt).eps) * float(
                    (x.abs() @ w_art.abs().t()).max()))


def test_fused_layer_types_agree_and_tied_lm_head_is_listed(tmp_path, monkeypatch):
    def scheme(name):  # attention dynamic, MLP weight-only: each fused set agrees
        return "dynamic" if "self_attn" in name else "none"

    artifact = int8_artifact(tmp_path, "llama", "bfloat16", scheme, tie_word_embeddings=True)
    description, tensors, _ = lower(artifact, tmp_path / "b", monkeypatch)
    assert description["model_quant_type"] == "W8A8_DYNAMIC"  # msModelSlim's priority: W8A8_DYNAMIC over W8A16
    assert vllm_ascend_layer_type(description, "model.layers.0.self_attn.qkv_proj") == "W8A8_DYNAMIC"
    assert vllm_ascend_layer_type(description, "model.layers.1.mlp.gate_up_proj") == "W8A16"
    assert description["lm_head.weight"] == "FLOAT" and "lm_head.weight" not in tensors  # vLLM skips a tied head


def test_float_model_is_all_float(tmp_path, monkeypatch):
    artifact = int8_artifact(tmp_path, "llama", "bfloat16", "float")
    description, _, _ = lower(artifact, tmp_path / "b", monkeypatch)
    assert description["model_quant_type"] == "FLOAT"
    assert {v for k, v in description.items() if k.endswith(".weight")} == {"FLOAT"}


def test_tokenizer_is_saved_beside_the_weights(tmp_path, monkeypatch, byte_tokenizer):
    artifact = int8_artifact(tmp_path, "llama", "bfloat16", "dynamic", tokenizer=byte_tokenizer,
                             vocab_size=len(byte_tokenizer))
    lower(artifact, tmp_path / "b", monkeypatch)
    assert (tmp_path / "b" / DIRECTORY / "tokenizer.json").exists()


def test_weights_split_into_msmodelslim_parts(tmp_path):
    tensors = {f"t{i}": torch.full((64,), i, dtype=torch.float32) for i in range(5)}
    files = write_weights(tmp_path, tensors, part_bytes=600)
    assert files == [f"quant_model_weights-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == set(files)
    (tmp_path / DESCRIPTION_FILE).write_text("{}")
    _, back = read_ascend_v1(tmp_path)
    assert all(torch.equal(back[k], v) for k, v in tensors.items()) and set(back) == set(tensors)


# -- the ATC bundle beside it ------------------------------------------------------------------
def test_atc_bundle_is_unchanged_by_the_directory(tmp_path, monkeypatch):
    """Every file of the bundle is byte for byte what the lowering writes without the AscendV1 directory."""
    import backends.ascend.lower as lower_module

    artifact = int8_artifact(tmp_path, "llama", "bfloat16", "static", False)
    lower(artifact, tmp_path / "with", monkeypatch)
    monkeypatch.setattr(lower_module, "ascend_v1_skip", lambda loaded: "switched off")
    with pytest.raises(AtcNotFound):
        lower_ascend(load_artifact(artifact), tmp_path / "without", OPTS, max_len=64)
    with_files = {p.relative_to(tmp_path / "with") for p in (tmp_path / "with").rglob("*") if p.is_file()}
    without = {p.relative_to(tmp_path / "without") for p in (tmp_path / "without").rglob("*") if p.is_file()}
    assert {p for p in with_files if p.parts[0] != DIRECTORY} == without
    assert {p.name for p in without} == {"prefill.onnx", "decode.onnx", "weights.data", "bundle.json", "build_om.sh"}
    for p in without - {Path("bundle.json")}:
        assert (tmp_path / "with" / p).read_bytes() == (tmp_path / "without" / p).read_bytes(), p
    assert (tmp_path / "with" / "build_om.sh").read_text() == build_script(OPTS)
    a, b = (json.loads((tmp_path / d / "bundle.json").read_text()) for d in ("with", "without"))
    a["extras"].pop("notes"), b["extras"].pop("notes")
    assert a == b


def _dynamic_down(name):
    return "dynamic" if name.endswith("down_proj") else "static"


def test_static_model_with_dynamic_units_gives_each_layer_its_type(tmp_path, monkeypatch):
    """The int8 pass's dynamic_fallback: static W8A8 layers beside W8A8_DYNAMIC ones, each with its own
    type and tensors (vllm-ascend picks a scheme per layer); the model's type is the highest present."""
    artifact = int8_artifact(tmp_path, "llama", "bfloat16", _dynamic_down, lambda name: _dynamic_down(name) == "dynamic")
    description, tensors, _ = lower(artifact, tmp_path / "b", monkeypatch)
    assert description["model_quant_type"] == "W8A8"
    for prefix in vllm_prefixes(load_artifact(artifact).model.config.n_layers):
        if prefix in ("model.embed_tokens", "lm_head"):
            continue
        kind = "W8A8_DYNAMIC" if prefix.endswith("down_proj") else "W8A8"
        assert vllm_ascend_layer_type(description, prefix) == kind, prefix
    for name in quantized_modules(load_artifact(artifact).model):
        assert (f"model.{name}.input_scale" in tensors) == (not name.endswith("down_proj")), name


# -- refusals ----------------------------------------------------------------------------------
def _fused_mismatch(name):
    return "static" if name.endswith("k_proj") else "dynamic"


def _other_scale(model):
    model.get_submodule("layers.0.self_attn.v_proj").input_scale.fill_(2.0 ** -4)


def _wide_zero_point(model):
    model.get_submodule("layers.1.mlp.down_proj").input_zero_point.fill_(-200)


def _float_gate(name):
    return "float" if name.endswith("gate_proj") else "dynamic"


@pytest.mark.parametrize("kwargs,match", [
    ({"scheme": "dynamic", "symmetric": False}, ("dynamic asymmetric INT8 activations; vllm-ascend's W8A8_DYNAMIC is "
                                              "symmetric per token; compile with activation_symmetric = true")),
    ({"scheme": _fused_mismatch}, r"q_proj/k_proj/v_proj are W8A8_DYNAMIC, W8A8, W8A8_DYNAMIC; vllm-ascend runs them"),
    ({"scheme": _float_gate}, r"gate_proj/up_proj are FLOAT, W8A8_DYNAMIC"),
    ({"scheme": "static", "symmetric": False, "tweak": _other_scale}, "different static input scales"),
    ({"scheme": "static", "symmetric": False, "tweak": _wide_zero_point}, "static zero point -200 is outside int8"),
])
def test_refusals_are_one_line_before_anything_is_written(tmp_path, kwargs, match):
    artifact = int8_artifact(tmp_path, **kwargs)
    with pytest.raises(ConfigError, match=match) as err:
        lower_ascend(load_artifact(artifact), tmp_path / "b", OPTS, max_len=64)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "b").exists()


def test_a_float32_artifact_is_written_in_bfloat16_and_says_so(tmp_path, monkeypatch):
    artifact = int8_artifact(tmp_path, "llama", "float32", "static", False)
    description, tensors, bundle = lower(artifact, tmp_path / "b", monkeypatch)
    config = json.loads((tmp_path / "b" / DIRECTORY / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.0.self_attn.q_proj.deq_scale"].dtype == torch.float32  # bfloat16's deq_scale
    loaded = load_artifact(artifact)
    assert torch.equal(tensors["model.layers.0.self_attn.q_proj.weight"], loaded.model.layers[0].self_attn.q_proj.weight)
    notes = " | ".join(bundle["extras"]["notes"])
    assert "written in bfloat16, as vllm-ascend runs INT8 layers (the artifact is float32)" in notes
    assert "float tensors (embeddings, norms, float layers) in bfloat16" in notes


@pytest.mark.parametrize("dtype, match", [
    ("float8_e4m3fn", r"a KV cache \(float8_e4m3fn\): AscendV1's one KV cache is vllm-ascend's INT8 'C8'"),
    ("int8", "an INT8 KV cache with head_dim 16: vllm-ascend's C8 cache holds K/V in blocks of 32 channels"),
])
def test_a_kv_cache_c8_cannot_hold_is_refused(tmp_path, dtype, match):
    loaded = load_artifact(int8_artifact(tmp_path))  # head_dim 16
    planted = LoadedModel(loaded.model, None, loaded.source,
                          replace(loaded.manifest, extras={**loaded.manifest.extras, "kv_cache": {"dtype": dtype}}))
    with pytest.raises(ConfigError, match=match) as err:
        check_ascend_v1(planted)
    assert "\n" not in str(err.value)


# -- the INT8 KV cache as vllm-ascend's C8 --------------------------------------------------------
C8_MODEL = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}  # head_dim 32: C8's NZ blocks
# modelslim_config.py, get_cache_scale_mapper with enable_c8_quant
C8_MAPPER = {".k_proj.kv_cache_scale": ".attn.k_cache_scale", ".k_proj.kv_cache_offset": ".attn.k_cache_offset",
             ".v_proj.kv_cache_scale": ".attn.v_cache_scale", ".v_proj.kv_cache_offset": ".attn.v_cache_offset"}


def c8_quant_layers(description: dict) -> list[int] | None:
    """modelslim_config.py, _add_kvcache_quant_metadata: C8 is on when kv_cache_type is "C8"; its layers
    are the ids (the digits between dots) of the keys holding "k_proj.kv_cache_scale"."""
    if description.get("kv_cache_type", "") != "C8":
        return None
    return [int("".join(re.findall(r"\.(\d+)\.", key))) for key in description if "k_proj.kv_cache_scale" in key]


def c8_param_name(name: str) -> str | None:
    """The attention parameter get_cache_scale_mapper loads a checkpoint tensor into (None: not a C8 one)."""
    return next((name[: -len(old)] + new for old, new in C8_MAPPER.items() if name.endswith(old)), None)


def c8_layer_param(loaded: torch.Tensor, dt: torch.dtype, num_kv_heads: int, head_size: int) -> torch.Tensor:
    """kv_c8.py: the parameter starts as [1] in the default (model) dtype; _c8_kv_scale_weight_loader squeezes
    the tensor and, the shapes differing, takes it cast to that dtype; process_weights_after_loading
    flattens it; attention_v1.py's _prepare_c8_scales (one TP rank: n_kv_heads * head_size values) views
    it [1, n_kv_heads, head_size]."""
    param = torch.ones(1, dtype=dt)
    loaded = loaded.squeeze()
    param = loaded.to(param.dtype).clone() if param.shape != loaded.shape else param.copy_(loaded)
    flat = param.flatten()
    assert flat.numel() == num_kv_heads * head_size
    return flat.view(1, num_kv_heads, head_size)


def npu_c8_round_trip(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x [tokens, n_kv_heads, head_size] stored and read back: _quantize_kv_to_int8 (codes = clamp(round(x *
    (1 / scale) + offset), -128, 127) as int8), then _dequant_paged_kv_to_dense's scale-only dequant
    (codes.to(dtype) * scale)."""
    inv = 1.0 / scale
    codes = torch.clamp(torch.round(x * inv + offset), -128, 127).to(torch.int8)
    return codes.to(x.dtype) * scale


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_int8_kv_cache_is_vllm_ascends_c8(tmp_path, monkeypatch, dtype):
    """Every layer is a C8 layer with its four tensors under the names vllm-ascend maps, n_kv_heads *
    head_size values in the model dtype, offsets 0; K/V quantized with the written scales as
    _quantize_kv_to_int8 does and read back as _dequant_paged_kv_to_dense does are the artifact's
    Int8KVQuant output, bit for bit in float32 (the scales lie on bfloat16's grid: written exactly)."""
    artifact = int8_artifact(tmp_path, "llama", dtype, "dynamic", kv_cache=True, **C8_MODEL)
    description, tensors, bundle = lower(artifact, tmp_path / "b", monkeypatch)
    model = load_artifact(artifact).model
    c, dt = model.config, torch.float16 if dtype == "float16" else torch.bfloat16
    assert description["kv_cache_type"] == description["kv_quant_type"] == "C8"
    assert sorted(c8_quant_layers(description)) == list(range(c.n_layers))
    assert description["model_quant_type"] == "W8A8_DYNAMIC"  # C8 is no linear scheme
    assert set(description) - {"version", "model_quant_type", "metadata", "group_size", "optional", "kv_cache_type",
                               "kv_quant_type"} == set(tensors)
    for prefix in vllm_prefixes(c.n_layers):  # the linear layers' types are untouched
        assert vllm_ascend_layer_type(description, prefix) == ("FLOAT" if prefix in ("model.embed_tokens", "lm_head")
                                                                else "W8A8_DYNAMIC"), prefix
    gen = torch.Generator().manual_seed(2)
    for i, layer in enumerate(model.layers):
        quant = layer.self_attn.kv_quant
        assert isinstance(quant, Int8KVQuant)
        params = {}
        for proj, kind in (("k_proj", "k"), ("v_proj", "v")):
            for leaf in ("kv_cache_scale", "kv_cache_offset"):
                name = f"model.layers.{i}.self_attn.{proj}.{leaf}"
                assert description[name] == "C8" and tensors[name].dtype == dt, name
                assert tensors[name].shape == (c.n_kv_heads * c.head_dim,), name
                assert c8_param_name(name) == f"model.layers.{i}.self_attn.attn.{kind}_cache_{leaf.split('_')[-1]}"
                params[f"{kind}_{leaf.split('_')[-1]}"] = c8_layer_param(tensors[name], torch.float32, c.n_kv_heads,
                                                                       c.head_dim)
        assert not params["k_offset"].any() and not params["v_offset"].any()
        assert torch.equal(params["k_scale"].flatten(), quant.k_scale)  # the artifact's scales, exactly
        assert torch.equal(params["v_scale"].flatten(), quant.v_scale)
        # K/V as the layer hands them to its cache, [B, Hkv, T, D]: in range, beyond it (the clamp), zeros,
        # and near ties (k + 1/2 steps, where rounding by the reciprocal and by the scale can part)
        s = quant.k_scale.reshape(1, -1, 1, c.head_dim)
        x = torch.randn(1, c.n_kv_heads, 40, c.head_dim, generator=gen) * s * 90
        x[..., :3, :] *= 3
        x[..., 3, :] = 0
        x[..., 4:24, :] = (torch.randint(-120, 120, (1, c.n_kv_heads, 20, c.head_dim), generator=gen) + 0.5) * s
        for kind, want in zip("kv", quant(x, x)):
            got = npu_c8_round_trip(x[0].transpose(0, 1), params[f"{kind}_scale"], params[f"{kind}_offset"])
            assert torch.equal(got.view(torch.int32), want[0].transpose(0, 1).view(torch.int32)), (i, kind)
    notes = " | ".join(bundle["extras"]["notes"])
    assert "C8 KV-cache scales (as the reciprocal it quantizes by)" in notes  # in dt, as vllm-ascend computes it
    assert "C8 KV-cache scales in" not in notes  # the scales themselves are held exactly
    assert f"{DIRECTORY}/ holds the INT8 KV cache as vllm-ascend's C8" in notes


def _int4(linear):
    return Int4Linear.from_float(linear, 32)


def _fp8(linear):
    return Fp8Linear.from_linear(linear, Fp8Format.for_linear(linear, activation_scheme="none"))


@pytest.mark.parametrize("convert,why", [(_int4, "vllm-ascend runs INT4 weight-only (W4A16) for MoE experts only"),
                                         (_fp8, "AscendV1 has no FP8 weight layout")])
def test_formats_without_ascend_v1_form_get_the_atc_bundle_and_a_note(tmp_path, monkeypatch, convert, why):
    hf_dir = tmp_path / "hf"
    make_hf_model("llama").save_pretrained(hf_dir)
    loaded = load_checkpoint(hf_dir, dtype="bfloat16", with_tokenizer=False)
    for name, linear in linear_modules(loaded.model).items():
        if name != "lm_head":
            loaded.model.set_submodule(name, convert(linear))
    artifact = save_artifact(tmp_path / "a", loaded.model, None, SourceInfo(str(hf_dir), "hf", "0" * 64), {}, [])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with pytest.raises(AtcNotFound):
        lower_ascend(load_artifact(artifact), tmp_path / "b", OPTS, max_len=64)
    assert not (tmp_path / "b" / DIRECTORY).exists() and (tmp_path / "b" / "prefill.onnx").exists()
    notes = json.loads((tmp_path / "b" / "bundle.json").read_text())["extras"]["notes"]
    skipped = [n for n in notes if n.startswith(f"no {DIRECTORY}/ directory: ")]
    assert len(skipped) == 1 and why in skipped[0] and "compile with the int8 pass" in skipped[0]


def test_cli_prints_where_the_directory_is(tmp_path, monkeypatch, capsys):
    artifact = int8_artifact(tmp_path, "llama", "bfloat16", "dynamic")
    out = tmp_path / "bundle"
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(sys, "argv", ["qcompile", "lower", str(artifact), "--target", "ascend", "--soc", "Ascend910B3",
                                      "--max-len", "64", "--buckets", "32,64", "-o", str(out)])
    from qcompile.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == AtcNotFound.exit_code
    assert (out / DIRECTORY / DESCRIPTION_FILE).exists()


def test_a_pipeline_for_ascend_refuses_dynamic_asymmetric_int8_before_any_work(tiny_checkpoint_with_tokenizer, tmp_path):
    import passes  # noqa: F401  (registers the int8 pass)
    from compiler.errors import PipelineValidationError
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_loaded

    path, _ = tiny_checkpoint_with_tokenizer("llama")
    config = PipelineConfig.from_dict({"passes": [{"name": "int8", "activation_symmetric": False}],
                                       "target": {"name": "ascend"}})
    with pytest.raises(PipelineValidationError, match="W8A8_DYNAMIC is symmetric per token") as err:
        compile_loaded(load_checkpoint(path), config, tmp_path / "a")
    assert "\n" not in str(err.value) and not (tmp_path / "a").exists()
