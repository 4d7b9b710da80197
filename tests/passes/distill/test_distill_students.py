"""QAT students (fake quantization, STE, re-packing) and layer-dropped students."""
import pytest
import torch
from distill_helpers import int4_copy, tiny_model

from compiler.errors import ConfigError
from compiler.formats.int4 import Int4Linear
from passes.distill.students import (
    FakeQuantInt4Linear,
    default_layer_map,
    freeze_codes,
    keep_layers_student,
    make_qat_student,
    parse_keep_layers,
    repack_int4,
    round_ste,
)


@pytest.mark.parametrize("zero_point", [True, False])
@pytest.mark.parametrize("in_features", [64, 40])  # 40: K padded to 64
def test_fake_quant_starts_at_the_int4_model_and_repacks_to_it(zero_point, in_features):
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, 24, bias=True)
    q = Int4Linear.from_float(linear, 32, zero_point)
    fq = FakeQuantInt4Linear(q, learn_qparams=False)
    x = torch.randn(3, in_features)
    ref = q(x)
    out = fq(x)
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < 1e-6, f"relative error {err}"
    back = fq.to_int4()
    for name in ("qweight", "qzeros", "scales", "bias"):
        assert torch.equal(getattr(back, name), getattr(q, name)), name
    assert back.format_meta() == q.format_meta()


def test_ste_passes_gradients_through_rounding():
    x = torch.tensor([0.2, 1.7, -2.4], requires_grad=True)
    y = round_ste(x)
    assert y.tolist() == [0.0, 2.0, -2.0]
    y.sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 1.0]


def test_qat_training_moves_codes_and_learnable_qparams_get_gradients():
    torch.manual_seed(0)
    q = Int4Linear.from_float(torch.nn.Linear(32, 8), 32)
    fq = FakeQuantInt4Linear(q, learn_qparams=True)
    assert isinstance(fq.scales, torch.nn.Parameter) and isinstance(fq.zeros, torch.nn.Parameter)
    target = torch.randn(16, 8)
    x = torch.randn(16, 32)
    opt = torch.optim.SGD(fq.parameters(), lr=0.5)
    for _ in range(5):
        opt.zero_grad()
        loss = ((fq(x) - target) ** 2).mean()
        loss.backward()
        assert fq.weight.grad.abs().sum() > 0 and fq.scales.grad.abs().sum() > 0
        opt.step()
    back = fq.to_int4()
    assert not torch.equal(back.qweight, q.qweight)  # training changed the stored codes
    err = ((back(x) - fq(x)).norm() / fq(x).norm()).item()
    assert err < 1e-5, f"repacked INT4 differs from the fake-quantized layer by {err}"


def test_frozen_qparams_are_buffers():
    fq = FakeQuantInt4Linear(Int4Linear.from_float(torch.nn.Linear(32, 8), 32), learn_qparams=False)
    names = {n for n, _ in fq.named_parameters()}
    assert names == {"weight", "bias"}


@pytest.mark.parametrize("learn_qparams", [False, True])
def test_frozen_codes_train_the_scales_alone(learn_qparams):
    """E2E-QP: after freeze_codes only the scales train; the function is unchanged at first, the
    re-packed codes stay those of the start, and the re-packed layer is the trained one."""
    torch.manual_seed(1)
    q = Int4Linear.from_float(torch.nn.Linear(40, 8), 32)  # K padded to 64
    fq = FakeQuantInt4Linear(q, learn_qparams)
    x, target = torch.randn(16, 40), torch.randn(16, 8)
    before = fq(x)
    fq.freeze_codes()
    torch.testing.assert_close(fq(x), before, rtol=0, atol=0)
    assert [n for n, p in fq.named_parameters() if p.requires_grad] == ["scales"]
    opt = torch.optim.SGD([fq.scales], lr=0.05)
    for _ in range(5):
        opt.zero_grad()
        ((fq(x) - target) ** 2).mean().backward()
        opt.step()
    back = fq.to_int4()
    assert torch.equal(back.qweight, q.qweight) and torch.equal(back.qzeros, q.qzeros)
    assert not torch.equal(back.scales, q.scales)
    assert ((back(x) - target) ** 2).mean() < ((q(x) - target) ** 2).mean()
    torch.testing.assert_close(back(x), fq(x), rtol=1e-5, atol=1e-5)


def test_freeze_codes_leaves_only_scales_trainable():
    qat = int4_copy(tiny_model())
    make_qat_student(qat)
    assert freeze_codes(qat) == 14
    assert {n.rsplit(".", 1)[-1] for n, p in qat.named_parameters() if p.requires_grad} == {"scales"}


def test_make_qat_student_swaps_and_repacks_every_int4_layer():
    teacher = tiny_model()
    student = int4_copy(teacher)
    ids = torch.randint(0, 64, (2, 8))
    ref = student(ids)
    assert make_qat_student(student) == 14
    assert not any(isinstance(m, Int4Linear) for m in student.modules())
    torch.testing.assert_close(student(ids), ref, rtol=1e-5, atol=1e-5)
    assert repack_int4(student) == 14
    assert sum(isinstance(m, Int4Linear) for m in student.modules()) == 14
    torch.testing.assert_close(student(ids), ref, rtol=1e-5, atol=1e-5)


def test_keep_layers_student_is_initialised_from_the_teacher():
    teacher = tiny_model(n_layers=4)
    student = keep_layers_student(teacher, [0, 2])
    assert student.config.n_layers == 2 and teacher.config.n_layers == 4
    assert torch.equal(student.layers[1].mlp.up_proj.weight, teacher.layers[2].mlp.up_proj.weight)
    assert student.layers[1].mlp.up_proj.weight.data_ptr() != teacher.layers[2].mlp.up_proj.weight.data_ptr()
    assert [layer.self_attn.layer_idx for layer in student.layers] == [0, 1]
    out = student.generate(torch.tensor([[1, 2, 3]]), 3)  # the KV cache path works with renumbered layers
    assert out.shape == (1, 6)
    # A teacher frozen by an earlier run (Distiller sets requires_grad False) still gives a trainable student.
    teacher.requires_grad_(False)
    assert all(p.requires_grad for p in keep_layers_student(teacher, [0, 2]).parameters())


def test_parse_keep_layers():
    assert parse_keep_layers("keep_layers:0,2,4", 6) == [0, 2, 4]
    assert parse_keep_layers("keep_layers:every2", 5) == [0, 2, 4]
    for bad in ("keep_layers:", "keep_layers:2,1", "keep_layers:0,0", "keep_layers:0,9", "keep_layers:a"):
        with pytest.raises(ConfigError):
            parse_keep_layers(bad, 6)


def test_default_layer_map():
    assert default_layer_map(2, 4) == [(0, 1), (1, 3)]  # the end of the pair each student layer replaces
    assert default_layer_map(3, 3) == [(0, 0), (1, 1), (2, 2)]
