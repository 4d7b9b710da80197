"""The C++ CPU kernels for the decoder layer's small ops (``rms_norm``, ``rope_qk``, ``silu_mul``,
``int4_linear``: ``compiler/kernels/cpu_ext.py``) against the torch code they replace, on fresh
random inputs, and the model's layers taking them only where they may."""
from __future__ import annotations

import pytest
import torch

from numerics import relative_error, stable_seed

from compiler.model.config import ModelConfig
from compiler.model.layers import MLP, Attention, GemmaRMSNorm, RMSNorm, apply_rope, rope_tables


@pytest.mark.parametrize("norm_type", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 16, 576), (2, 5, 64), (3, 7)])
def test_rms_norm_matches_the_torch_norm(cpu_ops, norm_type, shape):
    g = torch.Generator().manual_seed(stable_seed("rms", norm_type.__name__, shape))
    norm = norm_type(shape[-1], 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g))
    x = torch.randn(shape, generator=g) * 4
    got = cpu_ops.rms_norm(x, norm.weight, norm.eps, norm.weight_offset)
    want = norm.reference(x)
    error = relative_error(got, want)
    print(f"rms_norm {norm_type.__name__} {shape}: relative error {error:.1e}")
    assert got.shape == want.shape and error < 1e-6
    assert (got - want).abs().max() <= 4 * torch.finfo(torch.float32).eps * want.abs().max()


def test_rms_norm_lets_nan_through_to_its_row_only(cpu_ops):
    x, w = torch.randn(3, 64), torch.randn(64)
    x[1, 7] = float("nan")
    got = cpu_ops.rms_norm(x, w, 1e-6, 0.0)
    assert torch.isnan(got[1]).all() and torch.isfinite(got[[0, 2]]).all()


def qk_views(B, T, hq, hk, D, g):
    """q and k as the attention layer makes them: strided views of one fused projection's output."""
    qkv = torch.randn(B, T, (hq + 2 * hk) * D, generator=g)
    q, k, _ = qkv.split([hq * D, hk * D, hk * D], dim=-1)
    return q.view(B, T, hq, D).transpose(1, 2), k.view(B, T, hk, D).transpose(1, 2)


@pytest.mark.parametrize("B, T", [(1, 1), (1, 16), (2, 9)])
@pytest.mark.parametrize("rope_index", [0, 1])
def test_rope_qk_is_apply_rope_bit_for_bit(cpu_ops, B, T, rope_index):
    g = torch.Generator().manual_seed(stable_seed("rope", B, T, rope_index))
    q, k = qk_views(B, T, 9, 3, 64, g)
    positions = torch.randint(0, 4000, (B, T), generator=g)
    inv_freq = torch.stack([1.0 / (base ** (torch.arange(0, 64, 2).float() / 64)) for base in (1e4, 1e6)])
    cos, sin = rope_tables(inv_freq, positions, torch.float32)
    cos, sin = cos[:, rope_index : rope_index + 1], sin[:, rope_index : rope_index + 1]  # strided, as the layer slices
    got_q, got_k = cpu_ops.rope_qk(q, k, cos, sin)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    assert torch.equal(got_q, apply_rope(q, cos, sin)) and torch.equal(got_k, apply_rope(k, cos, sin))


def test_rope_qk_refuses_mismatched_tables(cpu_ops):
    g = torch.Generator().manual_seed(0)
    q, k = qk_views(1, 4, 9, 3, 64, g)
    cos = sin = torch.ones(1, 1, 3, 64)
    with pytest.raises(RuntimeError, match=r"cos/sin must be \[B, 1, T, D\]"):
        cpu_ops.rope_qk(q, k, cos, sin)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.rope_qk(q.double(), k, cos, sin)


@pytest.mark.parametrize("shape", [(1, 1, 2 * 1536), (1, 16, 2 * 1536), (5, 2 * 96), (3, 2 * 35)])
def test_silu_mul_is_torchs_swiglu_bit_for_bit(cpu_ops, shape):
    """``silu_mul(gate, up)`` = ``F.silu(gate) * up`` on the fused projection's halves (strided rows) and
    on separate contiguous ones alike: bit for bit torch wherever torch vectorises every element
    (rows of a multiple of 32; 35 is not, and torch's contiguous tail takes its scalar exp there),
    and always the same bits for the two layouts, so the fused and separate MLPs agree exactly."""
    g = torch.Generator().manual_seed(stable_seed("silu", shape))
    gate_up = torch.randn(shape, generator=g) * 6
    gate_up[..., 0] = -200.0  # exp(200) overflows: silu must give -0, not NaN
    gate, up = gate_up.chunk(2, dim=-1)
    fused, separate = cpu_ops.silu_mul(gate, up), cpu_ops.silu_mul(gate.contiguous(), up.contiguous())
    want = torch.nn.functional.silu(gate) * up
    assert fused.shape == want.shape and torch.equal(fused, separate) and torch.isfinite(fused).all()
    if shape[-1] // 2 % 32 == 0:
        assert torch.equal(fused, want)
    error = relative_error(fused, want)
    print(f"silu_mul {shape}: relative error {error:.1e}")
    assert error < 1e-6


def test_silu_mul_lets_nan_through(cpu_ops):
    gate, up = torch.randn(2, 64), torch.randn(2, 64)
    gate[0, 3] = float("nan")
    got = cpu_ops.silu_mul(gate, up)
    assert torch.isnan(got[0, 3]) and torch.isfinite(got[0, :3]).all() and torch.isfinite(got[1]).all()


@pytest.fixture
def tiny_attention():
    """An attention layer with fused q/k/v, random weights, and its RoPE tables for 5 positions; an MLP."""
    import compiler.model.layers as layers

    config = ModelConfig("LlamaForCausalLM", vocab_size=32, dim=64, n_layers=1, n_heads=4, n_kv_heads=2,
                         intermediate_size=96)
    torch.manual_seed(stable_seed("tiny attention"))
    attn = Attention(config, 0)
    attn.fuse_qkv(torch.nn.Linear(64, 64 + 2 * 32, bias=False))
    positions = torch.arange(5)[None]
    mlp = MLP(config)
    return attn, mlp, positions, *rope_tables(layers.rope_inv_freq(config), positions, torch.float32)


def test_the_layers_run_the_kernels_outside_autograd_only(cpu_ops, tiny_attention, monkeypatch):
    """Under no_grad a float32 layer's forward takes the C++ ops and gives the torch code's result
    (RoPE and SwiGLU bit for bit, the norm within its last bits); with autograd on, another dtype,
    or the kernels off, it runs the torch code."""
    import compiler.model.layers as layers
    from compiler.kernels.cpu_ext import cpu_kernels_for

    attn, mlp, positions, cos, sin = tiny_attention
    norm = RMSNorm(64, 1e-6)
    x = torch.randn(1, 5, 64)
    calls = []
    with torch.no_grad():
        monkeypatch.setattr(layers, "cpu_kernels_for", lambda t: calls.append(t) or cpu_kernels_for(t))
        fused = attn(x, cos, sin, positions, None), mlp(x), norm(x)
        assert len(calls) == 3, "the attention layer, the MLP and the norm each ask for the C++ kernels once"
        monkeypatch.setattr(layers, "cpu_kernels_for", lambda t: None)
        plain = attn(x, cos, sin, positions, None), mlp(x), norm.reference(x)
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
    assert relative_error(fused[2], plain[2]) < 1e-6
    with torch.no_grad():
        assert cpu_kernels_for(x) is not None
        assert cpu_kernels_for(x.double()) is None and cpu_kernels_for(x.bfloat16()) is None
    assert cpu_kernels_for(x) is None  # autograd on: the ops have no backward


@pytest.mark.parametrize("k, n, group_size, bias", [(576, 192, 64, False), (600, 64, 64, True), (1536, 576, 128, True)])
def test_int4_linear_is_the_python_path_bit_for_bit(cpu_ops, k, n, group_size, bias, monkeypatch):
    """``int4_linear`` = ``int4_cpu_matmul``'s casts, padding (600 is padded to 640), kernel and bias."""
    import compiler.kernels.int4_cpu as int4_cpu
    from compiler.formats.int4 import Int4Linear

    torch.manual_seed(stable_seed("int4_linear", k, n))
    layer = Int4Linear.from_float(torch.nn.Linear(k, n, bias=bias), group_size)
    x = torch.randn(2, 3, k)
    with torch.no_grad():
        got = layer(x)
        monkeypatch.setattr(int4_cpu, "cpu_kernels", lambda: None)
        want = layer(x)
    assert layer.kernel == int4_cpu.KERNEL and got.shape == (2, 3, n) and torch.equal(got, want)
