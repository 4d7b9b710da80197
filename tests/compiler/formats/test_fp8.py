"""FP8 primitives, the fp8 format and kernels: saturation, scales, kernels vs the dequantize reference.

The Triton kernels run on ``kernel_device``: compiled on a CUDA GPU (FP8 needs compute capability
8.9 or later), else in Triton's interpreter on the CPU. ``pytest -m gpu`` also runs the CUDA
dispatch (``fp8_gemm``) and ``Fp8Linear.forward`` on the GPU. Bounds on the relative error against
the float32 dequantize reference, per device (``GEMM_BOUNDS``):
"""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn as nn
from numerics import relative_error

from compiler.errors import ArtifactError
from compiler.formats.fp8 import Fp8Format, Fp8Linear
from compiler.kernels.dense_cpu import PACKED_FROM_ROWS, onednn_available
from compiler.kernels.fp8_gemm import FP8_KERNELS, dequant_gemm, fp8_gemm, select_kernel
from compiler.quant.fp8 import (
    FP8_DTYPES,
    quantize,
    quantize_per_token,
    quantize_per_token_group,
    saturating_cast,
    scale_from_amax,
    to_float32,
    weight_scale,
)

DTYPES = list(FP8_DTYPES.values())
GEMM_BOUNDS = {
    # The interpreter and torch on the CPU: float32 sums of exact FP8 products.
    "cpu": 1e-5,
    # Hopper's FP8 tensor cores accumulate with fewer bits than float32: the H200 run of
    # benchmarks/gpu_kernels.py measured 4.1e-4..1.0e-3 for K = 576..1536 and up to 4.4e-3 at
    # K = 14336 (docs/data/gpu_kernels_h200.json); the shapes here have K <= 192.
    "cuda": 5e-3,
}
PRECISE_ACC_BOUNDS = {"cpu": 1e-5, "cuda": 1e-3}  # precise_acc promotes partial sums (H200: <= 4.0e-4)


def stable_seed(*parts) -> int:
    """The same seed in every process (``hash`` of a tuple changes per process with PYTHONHASHSEED)."""
    return zlib.crc32(repr(parts).encode()) % 10_000


@pytest.fixture
def fp8_device(kernel_device) -> str:
    """``kernel_device``, where it can run FP8 Triton kernels."""
    if kernel_device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"FP8 Triton kernels need compute capability 8.9+, this GPU has {torch.cuda.get_device_capability()}")
    return kernel_device


def on(device: str, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


def fp8(lin: nn.Linear, input_scale=None, input_shift=None, outliers=None, **behaviour) -> Fp8Linear:
    """``Fp8Linear.from_linear`` in the format ``behaviour`` names, with the shift and outlier
    flags set by whether their tensors are given."""
    fmt = Fp8Format.for_linear(lin, input_shift=input_shift is not None,
                               outlier_channels=0 if outliers is None else len(outliers), **behaviour)
    return Fp8Linear.from_linear(lin, fmt, input_scale, input_shift=input_shift, outliers=outliers)


@pytest.mark.parametrize("dtype", DTYPES)
def test_saturating_cast_never_overflows_to_nan_or_inf(dtype):
    fmax = torch.finfo(dtype).max
    x = torch.tensor([0.0, 1.0, -1.0, fmax * 1.01, -fmax * 4, 1e30, -1e30, float("inf"), float("-inf")])
    q = saturating_cast(x, dtype).float()
    assert torch.isfinite(q).all()
    assert q[3] == fmax and q[4] == -fmax and q[5] == fmax and q[6] == -fmax and q[7] == fmax and q[8] == -fmax
    assert q[:3].tolist() == [0.0, 1.0, -1.0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5), (16, 170, 3, 64)])  # torch's cast, and the table lookup
def test_to_float32_is_torchs_cast_for_every_code(dtype, shape):
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    codes.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)[: codes.numel()]  # every code, NaNs included
    q = codes.view(dtype)
    for view in (q, q.transpose(0, -1)):  # and a non-contiguous one
        got, want = to_float32(view), view.float()
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got.nan_to_num(123.0), want.nan_to_num(123.0)) and torch.equal(got.isnan(), want.isnan())


def test_scales_map_absmax_to_format_max():
    w = torch.tensor([[1.0, -4.0], [0.5, 0.25], [0.0, 0.0]])
    e4 = torch.float8_e4m3fn
    per_channel = weight_scale(w, e4, "per_channel")
    assert torch.allclose(per_channel[:2], torch.tensor([4.0, 0.5]) / 448)
    assert per_channel[2] > 0  # an all-zero row gets a tiny positive scale, not 0 (no 0/0)
    assert torch.allclose(weight_scale(w, e4, "per_tensor"), torch.tensor([4.0 / 448]))
    assert torch.allclose(scale_from_amax(torch.tensor(57344.0), torch.float8_e5m2), torch.tensor(1.0))
    # the abs-max element lands exactly on the format's largest value
    q = quantize(w, per_channel[:, None], e4).float()
    assert q[0, 1] == -448 and q[1, 0] == 448 and (q[2] == 0).all()


def test_per_token_quantization_round_trip():
    torch.manual_seed(0)
    x = torch.randn(16, 64) * torch.logspace(-3, 3, 16)[:, None]  # rows of very different magnitudes
    q, s = quantize_per_token(x, torch.float8_e4m3fn)
    assert s.shape == (16,) and q.dtype == torch.float8_e4m3fn
    assert relative_error(q.float() * s[:, None], x) < 0.05


def _operands(m, n, k, a_dtype, b_dtype, granularity, seed):
    """Fresh random FP8 operands; activations reach 1e4, far beyond E4M3's 448 before scaling."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 1e4
    w = torch.randn(n, k, generator=g)
    xq, xs = quantize_per_token(x, a_dtype)
    ws = weight_scale(w, b_dtype, granularity)
    wq = quantize(w, ws[:, None], b_dtype)
    bias = torch.randn(n, generator=g)
    return x, w, xq, xs, wq, ws, bias


@pytest.mark.parametrize("kernel", ["scaled_mm", "triton"])
@pytest.mark.parametrize("dtypes", [(torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.float8_e5m2, torch.float8_e5m2)])
@pytest.mark.parametrize("granularity", ["per_channel", "per_tensor"])
@pytest.mark.parametrize("shape", [(5, 24, 40), (70, 130, 96)])
def test_kernels_match_dequantize_reference(kernel, dtypes, granularity, shape, fp8_device):
    """``scaled_mm`` is the CPU's kernel (on CUDA it needs 16-aligned shapes and is only benchmarked);
    the Triton kernel runs on ``kernel_device``."""
    device = fp8_device if kernel == "triton" else "cpu"
    bound = GEMM_BOUNDS[device]
    m, n, k = shape
    x, w, xq, xs, wq, ws, bias = _operands(m, n, k, *dtypes, granularity, seed=stable_seed(shape, granularity))
    ref = dequant_gemm(xq, xs, wq, ws, bias)
    assert relative_error(FP8_KERNELS[kernel](*on(device, xq, xs, wq, ws, bias)), ref) < bound
    # static (per-tensor) activation scale too, with values saturating at the format's max
    xs_static = torch.tensor([1e4 / torch.finfo(dtypes[0]).max])
    xq_static = quantize(x, xs_static, dtypes[0])
    ref = dequant_gemm(xq_static, xs_static, wq, ws, None)
    assert torch.isfinite(ref).all()
    assert relative_error(FP8_KERNELS[kernel](*on(device, xq_static, xs_static, wq, ws)), ref) < bound
    # and the reference itself is close to the float product
    assert relative_error(dequant_gemm(xq, xs, wq, ws, bias), x @ w.t() + bias) < 0.1


def test_gemm_bounds_catch_a_wrong_scale():
    """The bounds are far below what one wrong row scale costs (the kernel tests can fail)."""
    _, _, xq, xs, wq, ws, bias = _operands(70, 96, 130, torch.float8_e4m3fn, torch.float8_e4m3fn, "per_channel", 1)
    wrong = xs.clone()
    wrong[3] *= 2  # one token of 70 scaled wrong
    err = relative_error(dequant_gemm(xq, wrong, wq, ws, bias), dequant_gemm(xq, xs, wq, ws, bias))
    assert err > 10 * GEMM_BOUNDS["cuda"], err


def test_kernel_selection_by_device():
    assert select_kernel(torch.device("cpu")) == "scaled_mm"
    assert select_kernel(torch.device("cuda")) == "triton"
    assert select_kernel(torch.device("meta")) == "dequant"
    assert select_kernel(torch.device("cpu"), grouped=True) == "dequant"  # _scaled_mm takes no group scales
    assert select_kernel(torch.device("cuda"), grouped=True) == "triton"


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


def test_fp8_gemm_default_dispatch_matches_reference():
    _, _, xq, xs, wq, ws, bias = _operands(9, 17, 33, torch.float8_e4m3fn, torch.float8_e4m3fn, "per_channel", 3)
    assert relative_error(fp8_gemm(xq, xs, wq, ws, bias), dequant_gemm(xq, xs, wq, ws, bias)) < 1e-5


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


@pytest.mark.parametrize("precise_acc", [False, True])
def test_triton_gemm_tile_configs_match_reference(precise_acc, fp8_device):
    from compiler.kernels.fp8 import triton_fp8_gemm

    _, _, xq, xs, wq, ws, bias = _operands(37, 80, 160, torch.float8_e4m3fn, torch.float8_e4m3fn, "per_channel", 5)
    ref = dequant_gemm(xq, xs, wq, ws, bias)
    bound = (PRECISE_ACC_BOUNDS if precise_acc else GEMM_BOUNDS)[fp8_device]
    for block_m, block_n, block_k in [(16, 32, 32), (32, 64, 128)]:
        cfg = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": 2,
               "precise_acc": precise_acc}
        assert relative_error(triton_fp8_gemm(*on(fp8_device, xq, xs, wq, ws, bias), config=cfg), ref) < bound


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, k", [(3, 50), (9, 5000)])  # 5000 > the kernel's 4096-wide chunk
@pytest.mark.parametrize("shifted", [False, True])
def test_triton_activation_cast_matches_torch(dtype, rows, k, shifted, fp8_device):
    """Scales bitwise, and the saturated values before rounding, rounded by torch, give torch's codes
    bitwise; with an input shift, those of ``x - shift`` (Fp8Linear's input_shift, fused into the cast).
    On a GPU the codes the kernel writes are torch's bitwise too; Triton's interpreter rounds float32
    to FP8 in numpy, not exactly to nearest-even, so there only the values before rounding are compared."""
    from compiler.kernels.fp8 import triton_quantize_rows

    g = torch.Generator().manual_seed(k)
    x = torch.randn(rows, k, generator=g) * 3
    shift = torch.randn(k, generator=g) * 5 if shifted else None
    x[1, :7] = 1e6
    x[0] = shift if shifted else 0  # a row all zero (after any shift) gets the minimum scale, not NaN
    centred = x - shift if shifted else x
    static = torch.tensor([1e-3])  # far too small: everything beyond ±max saturates
    xd, shift_d = on(fp8_device, x, shift)
    for scale, (q_ref, s_ref) in ((None, quantize_per_token(centred, dtype)),
                                  (static, (quantize(centred, static, dtype), static))):
        pre_rounding = torch.empty(rows, k, device=fp8_device)
        _, s = triton_quantize_rows(xd, dtype, on(fp8_device, scale)[0], out=pre_rounding, shift=shift_d)
        assert torch.equal(s.cpu(), s_ref)
        pre_rounding = pre_rounding.cpu()
        assert torch.isfinite(pre_rounding).all() and pre_rounding.abs().max() <= torch.finfo(dtype).max
        assert torch.equal(pre_rounding.to(dtype).view(torch.uint8), q_ref.view(torch.uint8))
        q, _ = triton_quantize_rows(xd, dtype, on(fp8_device, scale)[0], shift=shift_d)
        assert q.dtype == dtype and torch.isfinite(q.float()).all()
        if fp8_device == "cuda":
            assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("kernel", ["dequant", "triton"])
@pytest.mark.parametrize("group", [32, 96])  # 96: the Triton kernel steps K by 32 inside each group
def test_group_scaled_activations_match_a_hand_dequantized_product(kernel, group, fp8_device):
    g = torch.Generator().manual_seed(group)
    x, w = torch.randn(21, 192, generator=g), torch.randn(40, 192, generator=g)
    x[:, 5] *= 1e5  # one outlier channel: only its own group's scales grow
    xq, xs = quantize_per_token_group(x, torch.float8_e4m3fn, group)
    assert xs.shape == (21, 192 // group)
    wq, ws = quantize(w, w.abs().amax(1, keepdim=True) / 448, torch.float8_e4m3fn), w.abs().amax(1) / 448
    by_hand = (xq.float().view(21, -1, group) * xs[..., None]).view(21, 192) @ (wq.float() * ws[:, None]).t()
    device = fp8_device if kernel == "triton" else "cpu"
    assert relative_error(FP8_KERNELS[kernel](*on(device, xq, xs, wq, ws)), by_hand) < GEMM_BOUNDS[device]
    assert relative_error(fp8_gemm(xq, xs, wq, ws), by_hand) < 1e-5  # the CPU default takes group scales too
    with pytest.raises(ValueError, match="no per-group activation scales"):
        FP8_KERNELS["scaled_mm"](xq, xs, wq, ws)
    # finer scales: per token, the outlier pushes the token's other channels into E4M3's subnormals;
    # per group, only the channels of its own group
    rest = slice(group, None)
    pq, ps = quantize_per_token(x, torch.float8_e4m3fn)
    per_token = relative_error((pq.float() * ps[:, None])[:, rest], x[:, rest])
    per_group = relative_error((xq.float().view(21, -1, group) * xs[..., None]).view(21, 192)[:, rest], x[:, rest])
    assert per_group < 0.05 < per_token


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
@pytest.mark.parametrize("grouped", [False, True])
def test_fp8_gemm_dispatch_on_cuda(grouped):
    """``fp8_gemm`` on CUDA tensors runs the Triton kernel (per-token and per-group scales)."""
    _, _, xq, xs, wq, ws, bias = _operands(33, 96, 192, torch.float8_e4m3fn, torch.float8_e4m3fn, "per_channel", 7)
    if grouped:
        x = torch.randn(33, 192, generator=torch.Generator().manual_seed(8))
        xq, xs = quantize_per_token_group(x, torch.float8_e4m3fn, 64)
    assert select_kernel(torch.device("cuda"), grouped) == "triton"
    ref = dequant_gemm(xq, xs, wq, ws, bias)
    y = fp8_gemm(*on("cuda", xq, xs, wq, ws, bias))
    assert y.is_cuda and relative_error(y, ref) < GEMM_BOUNDS["cuda"]


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
    bound = GEMM_BOUNDS["cuda"] + (2**-8 if dtype == torch.bfloat16 else 0)  # + the output's rounding to bfloat16
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


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("rows", [1, PACKED_FROM_ROWS - 1, PACKED_FROM_ROWS, 37])
def test_packed_float_copy_matches_the_reference_and_follows_the_buffers(rows):
    """The engine's packed copy (``pack_cpu_weight``) serves batches of 4+ rows: float32 sums in
    another order, within 1e-6 of the reference; below that the unpacked copy, bit for bit."""
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
        assert err < 1e-6 and (rows >= PACKED_FROM_ROWS or torch.equal(got, want))
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
