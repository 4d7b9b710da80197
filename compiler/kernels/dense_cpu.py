"""Float linear layers on the CPU through oneDNN with a pre-packed weight, for batches of rows.

torch's ``F.linear`` on the CPU calls MKL's sgemm on the ``[out, in]`` weight as stored. From a few
rows on, oneDNN on a weight reordered once into its blocked layout (``mkldnn._reorder_linear_weight``,
then ``mkldnn._linear_pointwise``, as vLLM's CPU backend and inductor's freezing do) is faster;
at one or two rows MKL's gemv is. Measured on this 2-core AVX-512 machine (``python
benchmarks/dense_cpu.py``), SmolLM2's 30 decoder layers of float32 projections (fused q/k/v and
gate/up), weights cold in cache, ms for all of them:

    rows               1     2     4     16    64
    F.linear (MKL)   17.1  20.0  29.2  42.1  74.1
    oneDNN packed    20.2  24.6  21.4  32.2  71.1

so ``PackedLinear`` keeps both: the weight as it is (``F.linear`` below ``PACKED_FROM_ROWS`` rows,
and every other user of the module's ``weight``: tied embeddings, state dicts) and the packed
copy (4 bytes a weight more, never saved). Both are float32 arithmetic; they differ only in the
order of the sums (~1e-7 relative). Only the engine packs (``ServingPlan.pack_cpu_weights``).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

PACKED_FROM_ROWS = 4  # the crossover above: at 3 rows the two are level


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (the same weight and bias parameters) that multiplies batches of
    ``PACKED_FROM_ROWS`` rows or more by a oneDNN-packed copy of its weight. The copy follows the
    weight: an in-place write or a new tensor repacks it on the next such call."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._packed: torch.Tensor | None = None
        self._packed_source: tuple | None = None

    def packed_weight(self) -> torch.Tensor:
        w = self.weight
        source = (w, None if w.is_inference() else w._version)
        if self._packed_source is None or self._packed_source[0] is not w or self._packed_source[1] != source[1]:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._packed_source = source
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < PACKED_FROM_ROWS * self.in_features or torch.is_grad_enabled():  # oneDNN's op has no backward
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(), bias, "none", [], "")


def packable(m: nn.Module) -> bool:
    """A float32 ``nn.Linear`` on the CPU (the case the crossover above was measured for)."""
    return type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32


def pack_linears(model: nn.Module) -> dict[str, list[str]]:
    """Replace every float32 CPU ``nn.Linear`` of ``model`` by a ``PackedLinear`` in place, each
    packed now (a one-time cost at load). Returns ``{"packed": [names]}``, empty when oneDNN is absent."""
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
                packed.append(f"{parent_name}.{name}" if parent_name else name)
    return {"packed": packed}
