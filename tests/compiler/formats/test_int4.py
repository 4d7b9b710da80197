"""``Int4Linear.forward`` on the CPU: which layers and calls take torch's INT4 kernel, the reasons
recorded when one cannot, and the repacked copy (never saved, rebuilt when the buffers change)."""
from __future__ import annotations

import pytest
import torch

import compiler.formats.int4 as int4_format
from compiler.formats.int4 import Int4Linear
from compiler.kernels import int4_cpu
from compiler.kernels.int4_cpu import KERNEL, kernel_unavailable_reason, reference_only

needs_kernel = pytest.mark.skipif(kernel_unavailable_reason() is not None,
                                  reason=f"no INT4 CPU kernel here: {kernel_unavailable_reason()}")


def layer(k: int = 128, n: int = 64, group: int = 64, bias: bool = True, seed: int = 0) -> Int4Linear:
    torch.manual_seed(seed)
    return Int4Linear.from_float(torch.nn.Linear(k, n, bias=bias), group)


@pytest.fixture
def kernel_calls(monkeypatch) -> list:
    """Counts the calls that reach the kernel (it still runs)."""
    calls = []

    def counting(x, pack, bias=None):
        calls.append(x.shape)
        return int4_cpu.int4_cpu_matmul(x, pack, bias)

    monkeypatch.setattr(int4_format, "int4_cpu_matmul", counting)
    return calls


@needs_kernel
def test_kernel_layers_run_the_kernel(kernel_calls):
    m = layer()
    assert (m.kernel, m.kernel_reason) == (KERNEL, None)
    assert f"kernel={KERNEL}" in repr(m)
    x = torch.randn(3, 128)
    m(x)
    assert kernel_calls == [x.shape]
    assert m(x).sub(m.reference_forward(x)).abs().max() > 0  # the kernel's bfloat16 rounding, not the reference


@pytest.mark.parametrize("n, group, why", [(40, 64, "out_features 40 is not a multiple of 16"),
                                           (64, 16, "group size 16: the kernel takes 32, 64, 128, 256")])
def test_layers_the_kernel_cannot_take_run_the_reference_and_say_why(kernel_calls, n, group, why):
    if kernel_unavailable_reason():
        why = kernel_unavailable_reason()
    m = layer(n=n, group=group)
    assert m.kernel == "reference" and m.kernel_reason.startswith(why)
    assert why in repr(m)
    x = torch.randn(2, 5, 128)
    torch.testing.assert_close(m(x), m.reference_forward(x), rtol=0, atol=0)
    assert kernel_calls == []


@needs_kernel
def test_activation_dtypes_the_kernel_cannot_take_are_recorded(kernel_calls):
    m = layer().double()
    x = torch.randn(2, 128, dtype=torch.float64)
    torch.testing.assert_close(m(x), m.reference_forward(x), rtol=0, atol=0)
    assert kernel_calls == [] and m.fallbacks == {"torch.float64 activations; the kernel takes torch.float32, torch.bfloat16, torch.float16"}


def test_a_cpu_without_the_vectorized_kernel_is_a_recorded_reason(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    kernel_unavailable_reason.cache_clear()
    try:
        m = layer()
    finally:
        monkeypatch.undo()
        kernel_unavailable_reason.cache_clear()
    assert m.kernel == "reference" and "CPU capability DEFAULT" in m.kernel_reason


def test_the_environment_switch_is_a_recorded_reason(monkeypatch):
    monkeypatch.setenv(int4_cpu.ENV_SWITCH, "0")
    kernel_unavailable_reason.cache_clear()
    try:
        m = layer()
    finally:
        monkeypatch.undo()
        kernel_unavailable_reason.cache_clear()
    assert m.kernel_reason == f"turned off by {int4_cpu.ENV_SWITCH}=0"


@needs_kernel
def test_reference_only_and_gradients_run_the_reference(kernel_calls):
    m = layer()
    x = torch.randn(4, 128)
    with reference_only():
        torch.testing.assert_close(m(x), m.reference_forward(x), rtol=0, atol=0)
    x.requires_grad_(True)
    m(x).sum().backward()  # the kernel has no backward: the reference carries the gradient
    assert x.grad is not None and kernel_calls == []
    with torch.no_grad():
        m(x)
    assert len(kernel_calls) == 1


@needs_kernel
def test_the_packed_copy_is_not_saved_and_follows_the_buffers():
    m = layer()
    keys = set(m.state_dict())
    x = torch.randn(3, 128)
    m(x)
    assert m._cpu_pack is not None and set(m.state_dict()) == keys == {"qweight", "scales", "qzeros", "bias"}

    before = m(x)
    m.scales = m.scales * 2  # a new tensor (version counter 0, as the old one's)
    torch.testing.assert_close(m(x), 2 * (before - m.bias) + m.bias, rtol=1e-5, atol=1e-5)

    other = layer(seed=1)
    m.load_state_dict(other.state_dict())  # copied in place: same storage, new values
    torch.testing.assert_close(m(x), other(x), rtol=0, atol=0)

    m.to(torch.bfloat16)  # a new scales tensor in a new dtype
    xb = x.bfloat16()
    rel = float((m(xb).float() - m.reference_forward(xb).float()).norm() / m.reference_forward(xb).float().norm())
    assert m._cpu_pack.scales_and_zeros.dtype == torch.bfloat16 and rel < 8e-3, rel

    with torch.no_grad():
        m.scales.mul_(2)  # written in place: the version counter moves
    torch.testing.assert_close(m(xb), 2 * (other.to(torch.bfloat16)(xb) - other.bias) + other.bias, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize("compute", ["auto", "w4a16"])
def test_inspect_reports_what_each_int4_layer_runs_on_this_cpu(tmp_path, group, compute):
    """Under the artifact's serving plan: W4A8 by default (where the kernels run it, with their ISA
    level), torch's kernel or the reference with why under a W4A16 plan."""
    from artifact_helpers import read_raw_manifest, rewrite_manifest
    from onnx_helpers import make_artifact

    from compiler.io.summary import artifact_summary
    from compiler.kernels.cpu_ext import cpu_isa_in_use
    from compiler.kernels.dispatch import W4A8
    from qcompile.cli.report import print_summary
    from rich.console import Console

    path = make_artifact(tmp_path, "llama", group)
    if compute != "auto":
        rewrite_manifest(path, {**read_raw_manifest(path), "serving": {"int4_compute": compute}})
    summary = artifact_summary(path)
    int4 = [layer for layer in summary["layers"] if layer["format"] == "int4"]
    if compute == "auto" and cpu_isa_in_use():
        expected = W4A8.describe()
    else:
        expected = KERNEL if group == 32 and not kernel_unavailable_reason() else "reference: "
    assert int4 and all(layer["cpu_kernel"].startswith(expected) for layer in int4)
    assert all("cpu_kernel" not in layer for layer in summary["layers"] if layer["format"] != "int4")
    console = Console(record=True, width=200)
    print_summary(console, summary)
    text = console.export_text()
    assert f"INT4 on this CPU: {len(int4)} layers run {int4[0]['cpu_kernel']}" in text
    assert f"qcompile's CPU kernels here: {cpu_isa_in_use()}" in text
