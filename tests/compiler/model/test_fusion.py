"""Serving-time fusion of q/k/v and gate/up (compiler/model/fusion.py): the fused model computes
what the unfused one does, for float and INT4 projections, and leaves alone what it cannot fuse."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from numerics import relative_error

from compiler.formats.fp8 import Fp8Format, Fp8Linear
from compiler.formats.int4 import Int4Linear
from compiler.io.load import load_checkpoint
from compiler.kernels.int4_cpu import KERNEL, reference_only
from compiler.model.fusion import fuse_projections
from serving.engine import Engine

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def quantize_projections(model: nn.Module, group_size: int = 32, names=PROJECTIONS) -> None:
    """Every projection named in ``names`` to round-to-nearest INT4 (the rest of the model stays float)."""
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for n in names:
                if hasattr(parent, n):
                    setattr(parent, n, Int4Linear.from_float(getattr(parent, n), group_size))


def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_fused_float_model_matches_unfused(tiny_checkpoint, arch):
    model = load_checkpoint(tiny_checkpoint(arch)[0]).model
    fused = copy.deepcopy(model)
    outcome = fuse_projections(fused)
    assert outcome == {"fused": [f"layers.{i}.{m}" for i in range(2) for m in ("self_attn", "mlp")]}
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    assert not any(hasattr(attn, n) for n in PROJECTIONS[:3]) and not hasattr(mlp, "gate_proj")
    assert attn.qkv_proj.weight.shape == (64 + 2 * 32, 64) and mlp.gate_up_proj.weight.shape == (2 * 96, 64)
    assert (attn.qkv_proj.bias is not None) == (arch == "qwen2")
    ids = torch.randint(0, 128, (2, 19))
    err = relative_error(logits_of(fused, ids), logits_of(model, ids))
    assert err < 1e-6, f"relative error {err:.2e}"


def test_fused_int4_model_matches_unfused_on_the_kernel_and_the_reference(tiny_checkpoint):
    model = load_checkpoint(tiny_checkpoint("llama")[0]).model
    quantize_projections(model)
    fused = copy.deepcopy(model)
    assert fuse_projections(fused)["fused"] == ["layers.0.self_attn", "layers.0.mlp", "layers.1.self_attn", "layers.1.mlp"]
    qkv = fused.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int4Linear) and qkv.out_features == 128 and qkv.kernel == KERNEL
    ids = torch.randint(0, 128, (1, 7))
    with reference_only():  # the format's exact numerics: fusion must not change a single code
        assert torch.equal(fused.layers[0].self_attn.qkv_proj.dequantized_weight(),
                           torch.cat([getattr(model.layers[0].self_attn, n).dequantized_weight() for n in PROJECTIONS[:3]]))
        err = relative_error(logits_of(fused, ids), logits_of(model, ids))
        assert err < 1e-6, f"reference path: relative error {err:.2e}"
    err = relative_error(logits_of(fused, ids), logits_of(model, ids))  # torch's int4 kernel, bfloat16 inside
    assert err < 1e-2, f"kernel path: relative error {err:.2e}"


def fp8_projections(model: nn.Module, per_tensor=("k_proj",), **behaviour) -> None:
    """Every q/k/v and gate/up to FP8 (``per_tensor`` ones with one weight scale), each set's members
    sharing the calibrated input buffers the fp8 pass would give them (one input, one statistic)."""
    torch.manual_seed(1)
    for layer in model.layers:
        for parent, names in ((layer.self_attn, PROJECTIONS[:3]), (layer.mlp, PROJECTIONS[3:])):
            k = getattr(parent, names[0]).in_features
            shift = torch.randn(k) * 0.1 if behaviour.get("input_shift") else None
            outliers = torch.randperm(k)[: behaviour.get("outlier_channels", 0)] if behaviour.get("outlier_channels") else None
            for n in names:
                linear = getattr(parent, n)
                fmt = Fp8Format.for_linear(linear, granularity="per_tensor" if n in per_tensor else "per_channel",
                                           **behaviour)
                setattr(parent, n, Fp8Linear.from_linear(linear, fmt, input_scale=0.05 if fmt.static else None,
                                                         input_shift=shift, outliers=outliers))


@pytest.mark.parametrize("behaviour", [{}, {"input_shift": True, "outlier_channels": 4},
                                       {"activation_scheme": "static"}, {"activation_scheme": "none"},
                                       {"activation_group_size": 32}])
@pytest.mark.parametrize("float_weight", ["1", "0"])  # the CPU's float copy, and the FP8 GEMM on the codes
def test_fused_fp8_model_matches_unfused(tiny_checkpoint, monkeypatch, behaviour, float_weight):
    monkeypatch.setenv("QCOMPILE_FP8_CPU_FLOAT_WEIGHT", float_weight)
    model = load_checkpoint(tiny_checkpoint("qwen2")[0]).model  # q/k/v with biases
    fp8_projections(model, **behaviour)
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == {"fused": [f"layers.{i}.{m}" for i in range(2) for m in ("self_attn", "mlp")]}
    qkv = fused.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.out_features == 128 and qkv.format.granularity == "per_channel"
    members = [getattr(model.layers[0].self_attn, n) for n in PROJECTIONS[:3]]
    assert torch.equal(qkv.weight.view(torch.uint8), torch.cat([m.weight for m in members]).view(torch.uint8))
    assert torch.equal(qkv.dequantized_weight(), torch.cat([m.dequantized_weight() for m in members]))
    ids = torch.randint(0, 128, (2, 11))
    err = relative_error(logits_of(fused, ids), logits_of(model, ids))
    assert err < 1e-6, f"relative error {err:.2e}"


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("behaviour", [{"activation_scheme": "static"}, {"input_shift": True}])
def test_fused_fp8_model_is_the_unfused_bit_for_bit_on_the_codes_kernel(tiny_checkpoint, behaviour):
    """On the codes kernel each output channel depends on its own codes and its row only, so fusing
    q/k/v and gate/up changes no bit of the logits. The engine's fused model and the unfused one a
    test or an evaluation runs must agree exactly: an FP8 layer rounds its input to a code, and a
    last-bit difference anywhere before it (a fused op computing SwiGLU's exp differently, say) moves
    a logit by 1e-2 now and then."""
    model = load_checkpoint(tiny_checkpoint("qwen2")[0]).model
    fp8_projections(model, **behaviour)
    fused = copy.deepcopy(model)
    fuse_projections(fused)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(3))
    assert torch.equal(logits_of(fused, ids), logits_of(model, ids))


def test_fp8_sets_with_different_input_quantization_stay_unfused(tiny_checkpoint):
    model = load_checkpoint(tiny_checkpoint("llama")[0]).model
    fp8_projections(model, input_shift=True)
    k = model.layers[1].self_attn.k_proj
    k.input_shift.add_(0.5)  # no longer the shift q and v subtract
    model.layers[0].mlp.up_proj = Fp8Linear.from_linear(nn.Linear(64, 96, bias=False))  # no shift: another format
    want = logits_of(model, ids := torch.randint(0, 128, (1, 9)))
    assert fuse_projections(model) == {"fused": ["layers.0.self_attn", "layers.1.mlp"],
                                       "its projections differ in format or layout": ["layers.0.mlp"],
                                       "its fp8 projections quantize their input differently": ["layers.1.self_attn"]}
    assert relative_error(logits_of(model, ids), want) < 1e-6


def test_sets_that_differ_stay_unfused_and_say_why(tiny_checkpoint):
    model = load_checkpoint(tiny_checkpoint("llama")[0]).model
    quantize_projections(model, names=("k_proj",))  # k in INT4, q and v float
    quantize_projections(model, group_size=32, names=("gate_proj",))
    model.layers[1].mlp.up_proj = Int4Linear.from_float(model.layers[1].mlp.up_proj, 64)  # another group size
    model.layers[0].mlp.up_proj = Int4Linear.from_float(model.layers[0].mlp.up_proj, 32)
    want = logits_of(model, ids := torch.randint(0, 128, (1, 9)))
    outcome = fuse_projections(model)
    assert outcome == {"fused": ["layers.0.mlp"],
                       "its projections differ in format or layout": ["layers.0.self_attn", "layers.1.self_attn",
                                                                      "layers.1.mlp"]}
    assert hasattr(model.layers[0].self_attn, "k_proj") and model.layers[0].self_attn.qkv_proj is None
    assert relative_error(logits_of(model, ids), want) < 1e-6


def test_other_formats_are_named_in_the_reason(tiny_checkpoint):
    class Marked(nn.Linear):  # any module type fusion does not know
        pass

    model = load_checkpoint(tiny_checkpoint("llama")[0]).model
    v = model.layers[0].self_attn.v_proj
    model.layers[0].self_attn.v_proj = Marked(v.in_features, v.out_features, bias=False)
    assert fuse_projections(model)["Marked projections are not fused"] == ["layers.0.self_attn"]


def test_engine_fuses_unless_the_plan_says_not_to(tiny_checkpoint):
    path = tiny_checkpoint("llama")[0]
    engine = Engine.from_loaded(load_checkpoint(path), device="cpu")
    assert len(engine.load_report.fusion["fused"]) == 4 and engine.model.layers[0].self_attn.qkv_proj is not None
    plain = Engine.from_loaded(load_checkpoint(path), device="cpu", fuse_projections=False)
    assert plain.load_report.fusion == {} and hasattr(plain.model.layers[0].self_attn, "q_proj")
