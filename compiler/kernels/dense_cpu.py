"""Float32 linear layers on the CPU on a weight packed once: qcompile's own kernel, else oneDNN.

torch's ``F.linear`` on the CPU calls MKL's sgemm on the ``[out, in]`` weight as stored. Two
packed ways are faster for the engine's batches: qcompile's ``dense_linear`` (C++, every ISA level: the
weight in blocks of 16 output channels, ``pack_dense_weight``, each tile's sums in registers over
the whole input, the weight read once as a stream), and oneDNN on a weight reordered into its
blocked layout (``mkldnn._reorder_linear_weight``, then ``mkldnn._linear_pointwise``, as vLLM's
CPU backend and inductor's freezing do). On SmolLM2's 30 decoder layers of float32 projections
(``python benchmarks/dense_cpu.py``; the table per host and row count:
docs/notes/2026-12-cpu-linear-layers-by-rows.md) qcompile's kernel reads the weight at the memory's
speed from one row on (425 MB in 12.7 ms on the AMD EPYC) and is level with oneDNN where both are
bound by arithmetic (512 rows).

So ``PackedLinear`` keeps the weight as it is (``F.linear`` for what the packed way does not take,
and every other user of the module's ``weight``: tied embeddings, state dicts) and one packed copy
(4 bytes a weight more, never saved): qcompile's where its kernel runs (from one row on; its rows
are summed in one order whatever the batch), else oneDNN's from ``dispatch.ONEDNN_FROM_ROWS`` rows (4
on an Intel CPU, where MKL's gemv wins below; 1 on any other). All are float32 arithmetic; they differ
only in the order of the sums (~1e-7 relative). Only the engine packs (``ServingPlan.pack_cpu_weights``).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from compiler.kernels.cpu_ext import cpu_kernels, cpu_kernels_status
from compiler.kernels.dispatch import FLOAT_MKL, FLOAT_ONEDNN, FLOAT_PACKED, float_kernel


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packing_available() -> bool:
    """Whether a float32 weight can be packed here (for either kernel)."""
    return cpu_kernels() is not None or onednn_available()


def packing_kernel() -> str:
    """What a packed weight runs here: qcompile's kernel (at its ISA level), or oneDNN and why not qcompile's."""
    if cpu_kernels() is not None:
        return FLOAT_PACKED.describe()
    return f"{FLOAT_ONEDNN.name} (qcompile's dense_linear: {cpu_kernels_status()})"


class DerivedTensor:
    """A tensor (or tensors) computed from source tensors and kept (never saved) until a source is
    replaced or written in place; then the next ``get`` computes it again. Serves the packed weight
    here, ``Fp8Linear``'s float32 copy of its codes and ``Int4Linear``'s packed copies."""

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


def pack_dense_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float32 [N, K] weight -> ``dense_linear``'s layout, float32 [ceil(N/16), K, 16]: per block
    of 16 output channels, the 16 channels' weights of each input channel (zeros where N is padded)."""
    n, k = weight.shape
    blocks = -(-n // 16)
    padded = torch.zeros(blocks * 16, k, dtype=weight.dtype, device=weight.device)
    padded[:n] = weight.detach()
    return padded.view(blocks, 16, k).transpose(1, 2).contiguous()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float32 [out, in] weight packed for ``dense``: ``dense_linear``'s layout where it runs, else oneDNN's."""
    if cpu_kernels() is not None:
        return pack_dense_weight(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``packed`` (``weight``'s ``pack_weight``, a tensor or a
    callable giving it) where ``dispatch.float_kernel`` takes it (enough rows, outside autograd)."""
    if float_kernel(x, weight, packed).name == FLOAT_MKL.name:
        return F.linear(x, weight, bias)
    packed = packed() if callable(packed) else packed
    bias = None if bias is None else bias.detach()
    if packed.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return cpu_kernels().dense_linear(x, packed, weight.shape[0], bias)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (the same weight and bias parameters) that multiplies batches of
    ``dispatch.packed_from_rows()`` rows or more by a packed copy of its weight (``pack_weight``). The copy
    follows the weight: an in-place write or a new tensor repacks it on the next such call."""

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
    ``Fp8Linear``'s), each packed now (a one-time cost at load). Returns ``{"packed": [names],
    "kernel": packing_kernel()}``, empty when neither packed kernel is here."""
    if not packing_available():
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
    return {"packed": packed, "kernel": packing_kernel()}
