"""The fp8 format (``compiler/formats/fp8.py``): ``Fp8Linear`` against float and against the dequantize
reference, its manifest entry, its CPU float copy. The primitives' tests are in
tests/compiler/quant/test_fp8_quant.py, the GEMM kernels' in tests/compiler/kernels/test_fp8_kernels.py.
``pytest -m gpu`` runs ``Fp8Linear.forward`` on a CUDA GPU too.
"""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn as nn
from numerics import FP8_GEMM_BOUNDS, relative_error, stable_seed

from compiler.errors import ArtifactError
from compiler.formats.fp8 import Fp8Format, Fp8Linear
from compiler.kernels.dense_cpu import packing_available
from compiler.kernels.dispatch import CODES_SWITCH, packed_from_rows
from compiler.kernels.fp8_gemm import dequant_gemm
from compiler.quant.fp8 import FP8_DTYPES, quantize, quantize_per_token

DTYPES = list(FP8_DTYPES.values())


def fp8(lin: nn.Linear, input_scale=None, input_shift=None, outliers=None, **behaviour) -> Fp8Linear:
    """``Fp8Linear.from_linear`` in the format ``behaviour`` names, with the shift and outlier
    flags set by whether their tensors are given."""
    fmt = Fp8Format.for_linear(lin, input_shift=input_shift is not None,
                               outlier_channels=0 if outliers is None else len(outliers), **behaviour)
    return Fp8Linear.from_linear(lin, fmt, input_scale, input_shift=input_shift, outliers=outliers)


@pytest.mark.parametrize("scheme", ["dynamic", "static", "none"])
@pytest.mark.parametrize("granularity", ["per_channel", "per_tensor"])
def test_fp8_linear_close_to_float(scheme, granularity):
    torch.manual_seed(1)
    lin = nn.Linear(48, 32)
    x = torch.randn(3, 7, 48)
    q = fp8(lin, granularity=granularity, activation_scheme=scheme,
            input_scale=float(x.abs().max()) / 448 if scheme == "static" else None)
    assert q.weight.dtype == torch.float8_e4m3fn and q.weight.shape == (32, 48)
    y = q(x)
    assert y.shape == (3, 7, 32) and y.dtype == x.dtype
    assert relative_error(y, lin(x)) < 0.08
    meta = q.format_meta()
    assert meta["format"] == "fp8" and meta["in_features"] == 48 and meta["out_features"] == 32
    assert meta["activation_scheme"] == scheme and meta["granularity"] == granularity


def test_fp8_linear_static_saturates_instead_of_nan():
    lin = nn.Linear(16, 8)
    q = fp8(lin, activation_scheme="static", input_scale=1.0 / 448)  # covers |x| <= 1
    y = q(torch.full((2, 16), 1e6))
    assert torch.isfinite(y).all()
    with pytest.raises(ValueError, match="input_scale"):
        fp8(lin, activation_scheme="static")


@pytest.mark.parametrize("scheme", ["dynamic", "none"])
def test_fp8_linear_keeps_bfloat16_models_in_bfloat16(scheme):
    torch.manual_seed(2)
    lin = nn.Linear(32, 16).to(torch.bfloat16)
    q = fp8(lin, activation_scheme=scheme)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    y = q(x)
    assert y.dtype == torch.bfloat16 and q.bias.dtype == torch.bfloat16
    assert relative_error(y, lin(x)) < 0.08


def test_module_to_dtype_keeps_fp8_codes_and_float32_scales():
    torch.manual_seed(3)
    lin = nn.Linear(32, 16)
    q = fp8(lin, activation_scheme="static", input_scale=0.01)
    codes = q.weight.clone()
    q.to(torch.bfloat16)
    assert q.weight.dtype == torch.float8_e4m3fn and torch.equal(q.weight.view(torch.uint8), codes.view(torch.uint8))
    assert q.weight_scale.dtype == torch.float32 and q.input_scale.dtype == torch.float32
    assert q.bias.dtype == torch.bfloat16


def test_fp8_linear_with_activation_groups_round_trips_its_meta():
    torch.manual_seed(4)
    lin = nn.Linear(64, 24)
    q = fp8(lin, activation_group_size=32)
    x = torch.randn(5, 64)
    assert relative_error(q(x), lin(x)) < 0.08
    meta = q.format_meta()
    assert meta["activation_group_size"] == 32
    empty = Fp8Linear.empty(meta, 64, 24, True, torch.float32)
    empty.load_state_dict(q.state_dict())
    assert torch.equal(empty(x), q(x))
    with pytest.raises(ValueError, match="must divide in_features"):
        fp8(lin, activation_group_size=48)
    with pytest.raises(ValueError, match="needs dynamic activations"):
        fp8(lin, activation_scheme="static", input_scale=1.0, activation_group_size=32)


@pytest.mark.parametrize("scheme", ["dynamic", "none"])
def test_input_shift_spends_the_rounding_on_x_minus_mean(scheme):
    """Inputs far from zero on a few channels (SmolLM2's outlier channels): subtracting their mean
    before the cast, with W·mean in the bias, cuts the error; the float form (dequantized weight and
    bias, what ONNX and msmodelslim export) computes the same function."""
    torch.manual_seed(2)
    lin = nn.Linear(64, 32, bias=True)
    offset = torch.zeros(64)
    offset[:4] = torch.tensor([40.0, -25.0, 30.0, -60.0])
    x = torch.randn(50, 64) + offset
    plain = fp8(lin, activation_scheme=scheme)
    shifted = fp8(lin, activation_scheme=scheme, input_shift=x.mean(0))
    ref = lin(x)
    assert relative_error(shifted(x), ref) < 0.5 * relative_error(plain(x), ref)
    if scheme == "none":  # no activation rounding: the float form agrees to float error
        float_form = x @ shifted.dequantized_weight().t() + shifted.dequantized_bias()
        assert torch.allclose(float_form, shifted(x), atol=1e-4)
    assert shifted.format_meta()["input_shift"] is True and "input_shift" not in plain.format_meta()
    clone = Fp8Linear.empty(shifted.format_meta(), 64, 32, False, torch.float32)
    clone.load_state_dict(shifted.state_dict())  # the loader passes the float layer's bias=False: the shift adds it
    assert torch.equal(clone(x), shifted(x))
    assert clone.to(torch.bfloat16).input_shift.dtype == torch.float32


@pytest.mark.parametrize("scheme", ["dynamic", "static", "none"])
def test_outlier_channels_stay_out_of_the_cast(scheme):
    """With ``outliers``, those input channels neither take FP8 rounding nor set a token's scale: the
    output is the FP8 product of the other channels plus a float product of theirs (by hand here);
    the float form (dequantized weight and bias, as ONNX exports) agrees, and the meta round-trips."""
    torch.manual_seed(5)
    lin = nn.Linear(64, 32, bias=True)
    x = torch.randn(40, 64)
    x[:, [7, 30]] *= 300.0  # huge, varying channels: the per-token scale would follow them
    mean = x.mean(0)
    idx = torch.tensor([7, 30])
    rest = torch.ones(64, dtype=torch.bool)
    rest[idx] = False
    scale = float((x - mean)[:, rest].abs().max()) / 448
    q = fp8(lin, activation_scheme=scheme, input_scale=scale, input_shift=mean, outliers=idx)
    assert torch.equal(q.outlier_weight, lin.weight[:, idx]) and q.weight[:, idx].float().eq(0).all()
    w_rest = q.dequantized_weight() * rest  # the FP8 columns
    centred = x - mean
    if scheme == "dynamic":
        xq, xs = quantize_per_token(centred * rest, torch.float8_e4m3fn)
        cast = xq.float() * xs[:, None]
    elif scheme == "static":
        cast = quantize(centred * rest, torch.tensor(scale), torch.float8_e4m3fn).float() * scale
    else:
        cast = centred * rest
    by_hand = cast @ w_rest.t() + centred[:, idx] @ lin.weight[:, idx].t() + q.bias
    assert torch.allclose(q(x), by_hand, atol=1e-4)
    plain = fp8(lin, activation_scheme=scheme, input_scale=float(centred.abs().max()) / 448, input_shift=mean)
    assert relative_error(q(x), lin(x)) < 0.5 * relative_error(plain(x), lin(x))
    if scheme == "none":  # no activation rounding: the float form agrees to float error
        assert torch.allclose(x @ q.dequantized_weight().t() + q.dequantized_bias(), q(x), atol=1e-3)
    clone = Fp8Linear.empty(q.format_meta(), 64, 32, True, torch.float32)
    clone.load_state_dict(q.state_dict())
    assert q.format_meta()["outlier_channels"] == 2 and torch.equal(clone(x), q(x))
    assert clone.to(torch.bfloat16).outlier_index.dtype == torch.int64
    with pytest.raises(ValueError, match="outlier_channels must be in"):
        Fp8Format(in_features=64, out_features=32, outlier_channels=64)


# Every manifest entry the fp8 pass has written, as it wrote it: these must keep loading.
RECORDED_ENTRIES = [
    {"format": "fp8", "in_features": 576, "out_features": 1536, "weight_dtype": "float8_e4m3fn",
     "granularity": "per_channel", "activation_scheme": "dynamic", "activation_dtype": "float8_e4m3fn",
     "input_shift": True},
    {"format": "fp8", "in_features": 64, "out_features": 96, "weight_dtype": "float8_e5m2", "granularity": "per_tensor",
     "activation_scheme": "static", "activation_dtype": "float8_e5m2", "outlier_channels": 8},
    {"format": "fp8", "in_features": 64, "out_features": 96, "weight_dtype": "float8_e4m3fn",
     "granularity": "per_channel", "activation_scheme": "none"},
    {"format": "fp8", "in_features": 64, "out_features": 96, "weight_dtype": "float8_e4m3fn",
     "granularity": "per_channel", "activation_scheme": "dynamic", "activation_dtype": "float8_e4m3fn",
     "activation_group_size": 32, "input_shift": True, "outlier_channels": 4},
]


@pytest.mark.parametrize("entry", RECORDED_ENTRIES)
def test_format_is_its_manifest_entry(entry):
    fmt = Fp8Format.from_dict(entry)
    assert fmt.to_dict() == entry and list(fmt.to_dict()) == list(entry)  # same keys, same order
    module = Fp8Linear.empty(entry, entry["in_features"], entry["out_features"], False, torch.float32)
    assert module.format == fmt and module.format_meta() == entry
    expected = {"weight", "weight_scale"} | ({"input_scale"} if entry["activation_scheme"] == "static" else set())
    expected |= {"input_shift", "bias"} if entry.get("input_shift") else set()
    expected |= {"outlier_index", "outlier_weight"} if entry.get("outlier_channels") else set()
    assert set(module.state_dict()) == expected
    with pytest.raises(Exception):
        fmt.granularity = "per_tensor"  # frozen


@pytest.mark.parametrize("change, message", [
    ({"activation_scheme": "per_token"}, "activation_scheme must be one of"),
    ({"weight_dtype": "float8_e4m3"}, "weight_dtype must be one of"),
    ({"in_features": "576"}, "in_features must be int"),
    ({"outlier_channels": 576}, "outlier_channels must be in"),
    ({"activation_group_size": 100}, "must divide in_features"),
    ({"block_size": 128}, "unknown keys"),
    ({"format": "int4"}, "format 'int4'"),
])
def test_malformed_entries_are_one_line_artifact_errors(change, message):
    entry = {**RECORDED_ENTRIES[0], **change}
    with pytest.raises(ArtifactError, match=message) as e:
        Fp8Format.from_dict(entry)
    assert "\n" not in str(e.value)
    missing = dict(RECORDED_ENTRIES[0])
    del missing["granularity"]
    with pytest.raises(ArtifactError, match="granularity"):
        Fp8Format.from_dict(missing)


def test_from_linear_refuses_tensors_the_format_does_not_name():
    lin = nn.Linear(32, 16)
    with pytest.raises(ValueError, match="input_shift"):
        Fp8Linear.from_linear(lin, Fp8Format.for_linear(lin), input_shift=torch.zeros(32))
    with pytest.raises(ValueError, match="outlier channels"):
        Fp8Linear.from_linear(lin, Fp8Format.for_linear(lin, outlier_channels=2))
    with pytest.raises(ValueError, match="format is 64 -> 16"):
        Fp8Linear.from_linear(lin, Fp8Format(in_features=64, out_features=16))


# -- the CUDA branches (pytest -m gpu) ---------------------------------------------------------


@pytest.mark.gpu(capability=(8, 9))
@pytest.mark.parametrize("variant", ["dynamic", "dynamic-shift", "dynamic-group", "static", "outliers", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_forward_on_cuda(variant, dtype):
    """Fp8Linear.forward's CUDA branch (Triton cast, fused shift, Triton GEMM) against the same
    layer on the CPU (torch's cast, ``_scaled_mm`` or the dequantize GEMM)."""
    g = torch.Generator().manual_seed(stable_seed(variant))
    lin = nn.Linear(128, 48).to(dtype)
    x = (torch.randn(40, 128, generator=g) * 2 + torch.randn(128, generator=g)).to(dtype)
    shift = x.float().mean(0) if variant in ("dynamic-shift", "outliers") else None
    options = {"activation_scheme": variant.split("-")[0] if variant != "outliers" else "dynamic",
               "input_shift": shift, "activation_group_size": 32 if variant == "dynamic-group" else 0,
               "outliers": torch.tensor([3, 77]) if variant == "outliers" else None,
               "input_scale": float(x.float().abs().max()) / 448 if variant == "static" else None}
    q = fp8(lin, **options)
    ref = q(x).float()
    got = q.to("cuda")(x.to("cuda"))
    assert got.is_cuda and got.dtype == dtype
    bound = FP8_GEMM_BOUNDS["cuda"] + (2**-8 if dtype == torch.bfloat16 else 0)  # + the output's rounding to bfloat16
    assert relative_error(got, ref) < bound


def _reference_forward(q: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """What ``Fp8Linear.forward`` computed before the CPU float copy, by hand: the dequantize reference
    (``dequant_gemm``) for FP8 activations, the per-call dequantized weight for weight-only."""
    x2 = x.reshape(-1, q.in_features)
    if not q.quantizes_activations:
        y = q._centred(x2).to(x.dtype) @ q.dequantized_weight().to(x.dtype).t()
        y = y + q.bias if q.bias is not None else y
    else:
        xq, xs = q.quantize_input(x2)
        y = dequant_gemm(xq, xs, q.weight, q.weight_scale, q.bias, x.dtype)
        if q.outlier_index is not None:
            y = y + q._outlier_part(x2)
    return y.reshape(*x.shape[:-1], q.out_features)


FLOAT_COPY_CASES = [
    dict(activation_scheme="dynamic"), dict(activation_scheme="dynamic", granularity="per_tensor"),
    dict(activation_scheme="static"), dict(activation_scheme="none"),
    dict(activation_scheme="dynamic", activation_group_size=16), dict(activation_scheme="dynamic", shift=True),
    dict(activation_scheme="dynamic", shift=True, outliers=True), dict(activation_scheme="none", outliers=True),
]


@pytest.mark.parametrize("case", FLOAT_COPY_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_float_copy_gives_the_reference_output_bit_for_bit(case, dtype, monkeypatch):
    """On the CPU the weight is dequantized once (``float_weight``) and the reference's arithmetic
    runs on the copy: equal to the dequantize reference on fresh random inputs (no NaN), and within
    float32 rounding of ``_scaled_mm``, the CPU kernel before it (relative error printed, -s)."""
    case = dict(case)
    shift, outliers = case.pop("shift", False), case.pop("outliers", False)
    seed = zlib.crc32(repr(sorted(case.items())).encode()) + shift + 2 * outliers
    torch.manual_seed(seed)
    lin = nn.Linear(64, 48, bias=True).to(dtype)
    x = (torch.randn(3, 5, 64) * 4).to(dtype)
    q = fp8(lin, input_scale=float(x.abs().max()) / 448 if case["activation_scheme"] == "static" else None,
            input_shift=x.float().reshape(-1, 64).mean(0) if shift else None,
            outliers=torch.tensor([3, 40]) if outliers else None, **case)
    got = q(x)
    assert q._float_weight.value is not None and q._float_weight.value.dtype == torch.float32
    assert torch.isfinite(got).all() and got.dtype == dtype
    assert torch.equal(got, _reference_forward(q, x))
    monkeypatch.setenv("QCOMPILE_FP8_CPU_FLOAT_WEIGHT", "0")
    before = q(x)  # per call: _scaled_mm (or the reference for groups / weight-only)
    err = relative_error(got, before)
    print(f"{case} shift={shift} outliers={outliers} {dtype}: float copy vs per-call path {err:.2e}")
    assert err < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.skipif(not packing_available(), reason="neither packed kernel is here")
@pytest.mark.parametrize("rows", sorted({1, max(packed_from_rows() - 1, 1), packed_from_rows(), 37}))
def test_packed_float_copy_matches_the_reference_and_follows_the_buffers(rows, monkeypatch):
    """The engine's packed copy (``pack_cpu_weight``, where the codes' kernel does not run) serves
    batches of ``packed_from_rows()`` rows or more (in ``fp8_linear``'s one call): float32 sums in
    another order, within 1e-6 of the reference; below that the unpacked copy, bit for bit."""
    monkeypatch.setenv(CODES_SWITCH, "0")
    torch.manual_seed(rows)
    lin = nn.Linear(576, 192)
    x = torch.randn(rows, 576) * 2
    q = fp8(lin, input_shift=x.mean(0))
    assert q.pack_cpu_weight() and not fp8(lin, activation_scheme="none").pack_cpu_weight()
    for _ in range(2):
        with torch.inference_mode():
            got = q(x)
        want = _reference_forward(q, x)
        err = relative_error(got, want)
        print(f"rows={rows}: packed copy vs reference {err:.2e}")
        assert err < 1e-6 and (rows >= packed_from_rows() or torch.equal(got, want))
        with torch.no_grad():
            q.weight_scale.mul_(2)  # in place: the float copy and the packed one are rebuilt


def test_cpu_float_copy_is_not_saved_follows_the_buffers_and_can_be_turned_off(monkeypatch):
    torch.manual_seed(4)
    lin, other = nn.Linear(32, 16), nn.Linear(32, 16)
    q, q2 = fp8(lin), fp8(other)
    x = torch.randn(6, 32)
    keys = set(q.state_dict())
    q(x)
    assert set(q.state_dict()) == keys and "_float_weight" not in keys
    q.load_state_dict(q2.state_dict())  # copied in place: the version counters move
    assert torch.equal(q(x), q2(x))
    with torch.no_grad():
        q.weight_scale.mul_(2)
    assert torch.equal(q(x), _reference_forward(q, x))
    monkeypatch.setenv("QCOMPILE_FP8_CPU_FLOAT_WEIGHT", "0")
    fresh = fp8(lin)
    fresh(x)
    assert fresh._float_weight.value is None


CODES_CASES = [
    dict(activation_scheme="dynamic"), dict(activation_scheme="dynamic", granularity="per_tensor"),
    dict(activation_scheme="static"), dict(activation_scheme="dynamic", shift=True),
    dict(activation_scheme="dynamic", weight_dtype="float8_e5m2", activation_dtype="float8_e5m2"),
]


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("case", CODES_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("rows", [1, 7, 37])
def test_a_float32_forward_multiplies_the_codes_and_keeps_no_float_copy(case, rows):
    """Outside autograd a float32 layer runs ``fp8_linear_codes`` on its codes: within 1e-6 of the
    dequantize reference (the float32 roundings in another order), no float copy built, the engine's
    ``pack_cpu_weight`` lays out the codes only, and the layout follows the weight when it changes."""
    case = dict(case)
    shift = case.pop("shift", False)
    torch.manual_seed(stable_seed("codes", rows, sorted(case.items()), shift))
    lin = nn.Linear(576, 200)  # 200 channels: a last block of 8; 576 inputs: whole pairs
    x = torch.randn(1, rows, 576) * 3
    q = fp8(lin, input_scale=float(x.abs().max()) / 448 if case["activation_scheme"] == "static" else None,
            input_shift=x.reshape(-1, 576).mean(0) if shift else None, **case)
    assert q.pack_cpu_weight() and q._packed_weight is None
    for _ in range(2):
        with torch.inference_mode():
            got = q(x)
        want = _reference_forward(q, x)
        err = relative_error(got, want)
        print(f"{case} shift={shift} rows={rows}: codes kernel vs reference {err:.2e}")
        assert err < 1e-6 and q._float_weight.value is None
        with torch.no_grad():
            q.weight.copy_(q.weight.view(torch.uint8).flip(0).view(q.weight.dtype))  # in place: laid out again


@pytest.mark.usefixtures("isa")
def test_the_codes_kernel_can_be_turned_off(monkeypatch):
    torch.manual_seed(5)
    q = fp8(nn.Linear(64, 32))
    monkeypatch.setenv(CODES_SWITCH, "0")
    with torch.no_grad():
        q(torch.randn(3, 64))
    assert q._cpu_codes.value is None and q._float_weight.value is not None
