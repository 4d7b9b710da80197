"""Float linear layers on the CPU through oneDNN with a pre-packed weight, for batches of rows.

torch's ``F.linear`` on the CPU calls MKL's sgemm on the ``[out, in]`` weight as stored; oneDNN
on a weight reordered once into its blocked layout (``mkldnn._reorder_linear_weight``, then
``mkldnn._linear_pointwise``, as vLLM's CPU backend and inductor's freezing do) is the other way.
Which is faster depends on the CPU: MKL's fast paths are Intel's. SmolLM2's 30 decoder layers of
float32 projections (fused q/k/v and gate/up), weights cold in cache, 2 threads, ms for all of
them (``python benchmarks/dense_cpu.py``):

    rows                               1     2     3     4     16    64
    Xeon (AVX-512, AMX):  MKL        17.1  20.0         29.2  42.1  74.1
                          oneDNN     20.2  24.6         21.4  32.2  71.1
    AMD EPYC (AVX-512):   MKL        34.8  61.3  72.1  47.1  56.9
                          oneDNN     21.6  22.4  17.6  18.0  29.5

so ``PackedLinear`` keeps both: the weight as it is (``F.linear`` below ``PACKED_FROM_ROWS`` rows,
and every other user of the module's ``weight``: tied embeddings, state dicts) and the packed
copy (4 bytes a weight more, never saved), and the crossover is 4 rows on an Intel CPU, 1 (oneDNN
always) on any other. Both are float32 arithmetic; they differ only in the order of the sums (~1e-7
relative). Only the engine packs (``ServingPlan.pack_cpu_weights``).
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor id (``GenuineIntel``, ``AuthenticAMD``, ...), "" where /proc/cpuinfo does not say."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# the crossovers above: on the Xeon MKL's gemv wins below 4 rows (at 3 the two are level); elsewhere oneDNN wins at every size
PACKED_FROM_ROWS = 4 if cpu_vendor() == "GenuineIntel" else 1


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class DerivedTensor:
    """A tensor computed from source tensors and kept (never saved) until a source is replaced or
    written in place; then the next ``get`` computes it again. Serves the packed weight here and
    ``Fp8Linear``'s float32 copy of its codes."""

    def __init__(self):
        self.value: torch.Tensor | None = None
        self._sources: tuple | None = None  # (the source tensors, their in-place versions)

    def get(self, sources: tuple, build) -> torch.Tensor:
        """The kept tensor, or ``build()``'s when any of ``sources`` (tensors or None) changed."""
        if not self._current(sources):
            self.value = build()
            self._sources = (sources, [None if t is None or t.is_inference() else t._version for t in sources])
        return self.value

    def _current(self, sources: tuple) -> bool:
        # a plain loop: this runs on every forward of a kept copy, where a generator's cost shows
        kept = self._sources
        if kept is None:
            return False
        for t, was, version in zip(sources, *kept):
            if t is not was or (version is not None and t._version != version):
                return False
        return True

    def drop(self) -> None:
        self.value = self._sources = None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float32 [out, in] weight in oneDNN's blocked layout, for ``dense``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``packed`` (``weight``'s ``pack_weight``, a tensor or a
    callable giving it) from ``PACKED_FROM_ROWS`` rows on, outside autograd (oneDNN's op has no backward)."""
    if packed is None or x.numel() < PACKED_FROM_ROWS * weight.shape[1] or torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    packed = packed() if callable(packed) else packed
    return torch.ops.mkldnn._linear_pointwise(x, packed, None if bias is None else bias.detach(), "none", [], "")


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (the same weight and bias parameters) that multiplies batches of
    ``PACKED_FROM_ROWS`` rows or more by a oneDNN-packed copy of its weight. The copy follows the
    weight: an in-place write or a new tensor repacks it on the next such call."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._packed = DerivedTensor()

    def packed_weight(self) -> torch.Tensor:
        return self._packed.get((self.weight,), lambda: pack_weight(self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias, self.packed_weight)


def packable(m: nn.Module) -> bool:
    """A float32 ``nn.Linear`` on the CPU (the case the crossover above was measured for)."""
    return type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32


def pack_linears(model: nn.Module) -> dict[str, list[str]]:
    """Replace every float32 CPU ``nn.Linear`` of ``model`` by a ``PackedLinear`` in place, and
    pack the float32 weight copy of every module that keeps one (``pack_cpu_weight()``, e.g.
    ``Fp8Linear``'s), each packed now (a one-time cost at load). Returns ``{"packed": [names]}``,
    empty when oneDNN is absent."""
    if not onednn_available():
        return {}
    packed = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if packable(child):
                layer = PackedLinear(child)
                with torch.no_grad():
                    layer.packed_weight()
                setattr(parent, name, layer)
            elif not (hasattr(child, "pack_cpu_weight") and child.pack_cpu_weight()):
                continue
            packed.append(f"{parent_name}.{name}" if parent_name else name)
    return {"packed": packed}
