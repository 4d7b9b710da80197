"""oneDNN-packed float linear layers (``compiler/kernels/dense_cpu.py``) against ``F.linear``, on
fresh random inputs; relative errors are printed (-s)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import relative_error

from compiler.kernels.dense_cpu import PACKED_FROM_ROWS, PackedLinear, onednn_available, pack_linears

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")

# float32 both ways, summed in another order: measured ~1e-7
TOLERANCE = 1e-6


@pytest.mark.parametrize("k, n, bias", [(576, 960, False), (1536, 576, True), (64, 49, True)])
@pytest.mark.parametrize("rows", sorted({1, max(PACKED_FROM_ROWS - 1, 1), PACKED_FROM_ROWS, 37}))
def test_packed_linear_matches_f_linear(k, n, bias, rows):
    torch.manual_seed(k + n + rows)
    linear = torch.nn.Linear(k, n, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(1, rows, k)  # [B, T, K]
    with torch.inference_mode():
        got, ref = packed(x), F.linear(x, linear.weight, linear.bias)
    err = relative_error(got, ref)
    print(f"{k}->{n} bias={bias} rows={rows}: relative error {err:.2e}")
    assert got.shape == ref.shape and err < TOLERANCE
    assert (packed._packed.value is not None) == (rows >= PACKED_FROM_ROWS)  # the path under test was taken


def test_the_packed_copy_follows_the_weight():
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 16)
    packed = PackedLinear(linear)
    x = torch.randn(PACKED_FROM_ROWS, 32)
    with torch.no_grad():
        packed(x)
        linear.weight.mul_(2)  # in place: the shared parameter's version moves
        assert relative_error(packed(x), F.linear(x, linear.weight, linear.bias)) < TOLERANCE
        packed.weight = torch.nn.Parameter(torch.randn(16, 32))  # a new tensor
        assert relative_error(packed(x), F.linear(x, packed.weight, packed.bias)) < TOLERANCE


def test_pack_linears_packs_float32_cpu_linears_only_and_keeps_their_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).to(torch.bfloat16), torch.nn.ReLU())
    weight = model[0].weight
    assert pack_linears(model) == {"packed": ["0"]}
    assert type(model[0]) is PackedLinear and model[0].weight is weight  # tied weights stay tied
    assert type(model[1]) is torch.nn.Linear
    assert set(model.state_dict()) == {"0.weight", "0.bias", "1.weight", "1.bias"}  # the copy is never saved


def test_a_training_forward_keeps_autograd():
    torch.manual_seed(0)
    packed = PackedLinear(torch.nn.Linear(8, 4))
    packed(torch.randn(PACKED_FROM_ROWS, 8)).sum().backward()
    assert packed.weight.grad is not None
