"""Packed float linear layers (``compiler/kernels/dense_cpu.py``: qcompile's ``dense_linear`` and
the oneDNN fallback) against ``F.linear``, on fresh random inputs; relative errors are printed (-s)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import kernel_levels, kernels_at
from numerics import relative_error

from compiler.kernels import dense_cpu
from compiler.kernels.cpu_ext import cpu_isa_in_use, use_isa
from compiler.kernels.dense_cpu import PackedLinear, dense, pack_dense_weight, pack_linears, pack_weight
from compiler.kernels.dispatch import packed_from_rows

# float32 both ways, summed in another order: measured ~1e-7
TOLERANCE = 1e-6

@pytest.fixture(params=[*(f"qcompile-{level}" for level in kernel_levels()), "onednn"])
def kernel(request):
    """Each packed way in turn: qcompile's kernel at each ISA level the CPU runs, and oneDNN
    (qcompile's turned off)."""
    if request.param == "onednn":
        if not dense_cpu.onednn_available():
            pytest.skip("this torch has no oneDNN")
        with use_isa(None):
            yield request.param
        return
    level = request.param.removeprefix("qcompile-")
    with kernels_at(None if level == "None" else level):
        yield "qcompile"


@pytest.mark.parametrize("k, n, bias", [(576, 960, False), (1536, 576, True), (64, 49, True), (7, 3, False)])
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 9, 37])
def test_packed_linear_matches_f_linear(kernel, k, n, bias, rows):
    torch.manual_seed(k + n + rows)
    linear = torch.nn.Linear(k, n, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(1, rows, k)  # [B, T, K]
    with torch.inference_mode():
        got, ref = packed(x), F.linear(x, linear.weight, linear.bias)
    err = relative_error(got, ref)
    print(f"{kernel} {k}->{n} bias={bias} rows={rows}: relative error {err:.2e}")
    assert got.shape == ref.shape and err < TOLERANCE
    assert (packed._packed.value is not None) == (rows >= packed_from_rows())  # the path under test was taken
    assert packed._packed.value is None or packed._packed.value.is_mkldnn == (kernel == "onednn")


def test_the_dense_kernel_gives_a_row_the_same_bits_in_any_batch(cpu_ops):
    """Each output is its own row's multiply-add chain over the input in one order, so a token's
    result does not depend on the batch (tiles of 8 rows, 3 blocks of 16 channels, and their remainders)."""
    torch.manual_seed(1)
    w, b = torch.randn(200, 96), torch.randn(200)
    x = torch.randn(19, 96)
    packed = pack_dense_weight(w)
    ops = cpu_ops
    batch = ops.dense_linear(x, packed, 200, b)
    assert relative_error(batch, F.linear(x, w, b)) < TOLERANCE
    for r in range(19):
        assert torch.equal(ops.dense_linear(x[r : r + 1], packed, 200, b)[0], batch[r])


def test_the_dense_kernel_keeps_nan_and_inf_in_their_rows(cpu_ops):
    torch.manual_seed(2)
    w = torch.randn(40, 24)
    x = torch.randn(10, 24)
    x[3, 5], x[7, 0] = float("nan"), float("inf")
    got = cpu_ops.dense_linear(x, pack_dense_weight(w), 40, None)
    want = x @ w.t()
    assert got[3].isnan().all() and not got[7].isfinite().any()
    others = [r for r in range(10) if r not in (3, 7)]
    assert relative_error(got[others], want[others]) < TOLERANCE


def test_the_dense_kernel_refuses_a_weight_packed_for_other_sizes(cpu_ops):
    ops = cpu_ops
    packed = pack_dense_weight(torch.randn(40, 24))
    with pytest.raises(RuntimeError, match="pack_dense_weight"):
        ops.dense_linear(torch.randn(2, 25), packed, 40, None)  # another K
    with pytest.raises(RuntimeError, match="pack_dense_weight"):
        ops.dense_linear(torch.randn(2, 24), packed, 64, None)  # more blocks than packed
    with pytest.raises(RuntimeError, match="bias"):
        ops.dense_linear(torch.randn(2, 24), packed, 40, torch.randn(39))
    assert ops.dense_linear(torch.randn(0, 24), packed, 40, None).shape == (0, 40)


def test_the_packed_copy_follows_the_weight(kernel):
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 16)
    packed = PackedLinear(linear)
    x = torch.randn(packed_from_rows(), 32)
    with torch.no_grad():
        packed(x)
        linear.weight.mul_(2)  # in place: the shared parameter's version moves
        assert relative_error(packed(x), F.linear(x, linear.weight, linear.bias)) < TOLERANCE
        packed.weight = torch.nn.Parameter(torch.randn(16, 32))  # a new tensor
        assert relative_error(packed(x), F.linear(x, packed.weight, packed.bias)) < TOLERANCE


def test_dense_takes_the_weight_as_stored_below_the_crossover_and_in_autograd(kernel):
    torch.manual_seed(3)
    w, x = torch.randn(16, 32), torch.randn(5, 32)
    calls = []

    def packed():
        calls.append(1)
        return pack_weight(w)

    with torch.no_grad():
        assert torch.equal(dense(x[:0], w, None, packed), F.linear(x[:0], w))
    assert torch.equal(dense(x, w, None, packed), F.linear(x, w))  # autograd on: F.linear
    assert not calls


def test_pack_linears_packs_float32_cpu_linears_only_and_keeps_their_parameters(kernel):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).to(torch.bfloat16), torch.nn.ReLU())
    weight = model[0].weight
    want_kernel = f"dense_linear [{cpu_isa_in_use()}]" if kernel == "qcompile" else "oneDNN _linear_pointwise (qcompile's dense_linear: "
    report = pack_linears(model)
    assert report["packed"] == ["0"] and report["kernel"].startswith(want_kernel)
    assert type(model[0]) is PackedLinear and model[0].weight is weight  # tied weights stay tied
    assert type(model[1]) is torch.nn.Linear
    assert set(model.state_dict()) == {"0.weight", "0.bias", "1.weight", "1.bias"}  # the copy is never saved


def test_a_training_forward_keeps_autograd(kernel):
    torch.manual_seed(0)
    packed = PackedLinear(torch.nn.Linear(8, 4))
    packed(torch.randn(packed_from_rows(), 8)).sum().backward()
    assert packed.weight.grad is not None
