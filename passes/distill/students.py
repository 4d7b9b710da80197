"""Students for distillation: the INT4 model trained with fake quantization (QAT), or a smaller copy.

QAT: every ``Int4Linear`` becomes a ``FakeQuantInt4Linear`` whose float master weight starts at the
dequantized INT4 weight, so the first forward is exactly the INT4 model's. Training runs the
quantize-dequantize round trip with a straight-through estimator on the rounding; scales and zero
points are the INT4 model's (frozen buffers) or learnable parameters. ``freeze_codes`` fixes the
codes for EfficientQAT's E2E-QP (only the scales train end to end). ``repack_int4`` turns each back
into an ``Int4Linear`` in the same format (group size, zero-point mode, MatMulNBits layout).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from compiler.formats.int4 import Int4Linear
from compiler.model.transformer import Transformer
from compiler.quant.int4 import QMAX, pad_columns, quantize, storage_scale
from passes.distill.errors import DistillConfigError


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """Round in the forward pass, identity in the backward pass (straight-through estimator)."""
    return x + (x.round() - x).detach()


class FakeQuantInt4Linear(nn.Module):
    """Float master weight [N, K] trained through INT4 fake quantization (STE on the rounding).

    ``scales`` [N, n_blocks] and ``zeros`` [N, n_blocks] (float, integral values) are parameters when
    ``learn_qparams`` (the zero point then also rounds through the STE), else buffers. After
    ``freeze_codes`` the weight is the fixed ``codes`` [N, n_blocks, g] times the trainable scales.
    """

    def __init__(self, source: Int4Linear, learn_qparams: bool):
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        self.group_size, self.zero_point = source.group_size, source.zero_point
        q, zero = source.codes()
        self.weight = nn.Parameter(source.dequantized_weight().float().clone())
        scales, zeros = source.scales.float().clone(), zero.float()
        if learn_qparams:
            self.scales = nn.Parameter(scales)
            self.zeros = nn.Parameter(zeros, requires_grad=source.zero_point)
        else:
            self.register_buffer("scales", scales)
            self.register_buffer("zeros", zeros)
        self.bias = None if source.bias is None else nn.Parameter(source.bias.float().clone())
        self.storage_dtype = source.scales.dtype
        self.register_buffer("codes", None)  # uint8 [N, n_blocks, g] once frozen

    def _codes(self, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """The weight's INT4 codes [N, n_blocks, g] as floats, differentiable by STE."""
        w = pad_columns(self.weight, self.group_size)
        groups = w.view(w.shape[0], -1, self.group_size)
        return (round_ste(groups / scale) + zero).clamp(0, QMAX)

    def _stored_scales(self) -> torch.Tensor:
        """The scales as ``to_int4`` stores them (``storage_scale``), the gradient straight through
        the rounding, so that training sees the layer it will write."""
        scales = self.scales.float()
        return scales + (storage_scale(scales, self.storage_dtype).float() - scales).detach()

    def fake_quantized_weight(self) -> torch.Tensor:
        """The weight the INT4 model would hold, differentiable by STE: [N, K]."""
        scale = self._stored_scales()[..., None]
        zero = round_ste(self.zeros).clamp(0, QMAX)[..., None]
        q = self._codes(scale, zero) if self.codes is None else self.codes.float()
        return ((q - zero) * scale).flatten(1)[:, : self.in_features]

    @torch.no_grad()
    def freeze_codes(self) -> None:
        """Fix the codes the weight rounds to now and train the scales alone (EfficientQAT's E2E-QP,
        Chen et al. 2024): the gradient reaches each scale through every code of its group, and the
        few parameters cannot overfit as the weights do. Weight and zero points stop training."""
        zero = self.zeros.round().clamp(0, QMAX)[..., None]
        self.codes = self._codes(self._stored_scales()[..., None], zero).to(torch.uint8)
        scales = self.scales.detach().clone()
        del self.scales
        self.scales = nn.Parameter(scales)
        for frozen in (self.weight, self.zeros, self.bias):
            if frozen is not None:
                frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.fake_quantized_weight().to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    @torch.no_grad()
    def to_int4(self) -> Int4Linear:
        """Re-pack into the INT4 format the student came from."""
        scale = storage_scale(self.scales, self.storage_dtype)
        zero = self.zeros.round().clamp(0, QMAX).to(torch.uint8)
        if self.codes is None:
            q = quantize(pad_columns(self.weight.to(self.storage_dtype), self.group_size), scale, zero, self.group_size)
        else:
            q = self.codes.flatten(1)
        bias = None if self.bias is None else self.bias.to(self.storage_dtype)
        return Int4Linear.from_codes(q, scale, zero, self.in_features, self.group_size, self.zero_point, bias)


def _swap(model: nn.Module, kind: type, make) -> int:
    names = [n for n, m in model.named_modules() if isinstance(m, kind)]
    for name in names:
        model.set_submodule(name, make(model.get_submodule(name)))
    return len(names)


def make_qat_student(model: Transformer, learn_qparams: bool = False) -> int:
    """Swap every ``Int4Linear`` of ``model`` for a trainable fake-quantized twin (in place); return the count."""
    return _swap(model, Int4Linear, lambda m: FakeQuantInt4Linear(m, learn_qparams))


def freeze_codes(model: Transformer) -> int:
    """Leave only the INT4 scales of a QAT student trainable, its codes fixed (E2E-QP); return the count."""
    layers = [m for m in model.modules() if isinstance(m, FakeQuantInt4Linear)]
    model.requires_grad_(False)
    for m in layers:
        m.freeze_codes()
    return len(layers)


def repack_int4(model: Transformer) -> int:
    """Swap every ``FakeQuantInt4Linear`` back to ``Int4Linear`` (in place); return the count."""
    return _swap(model, FakeQuantInt4Linear, lambda m: m.to_int4())


def parse_keep_layers(spec: str, n_layers: int) -> list[int]:
    """``keep_layers:0,2,4`` (or ``keep_layers:every2``) -> sorted layer indices of the teacher."""
    body = spec.removeprefix("keep_layers:")
    try:
        if body.startswith("every"):
            keep = list(range(0, n_layers, int(body.removeprefix("every"))))
        else:
            keep = [int(x) for x in body.split(",") if x.strip()]
    except ValueError:
        raise DistillConfigError(f"student {spec!r}: write keep_layers:0,2,4 (layer indices) or keep_layers:every2") from None
    if not keep or sorted(set(keep)) != keep or keep[0] < 0 or keep[-1] >= n_layers:
        raise DistillConfigError(f"student {spec!r}: layer indices must be increasing, distinct and in [0, {n_layers - 1}]")
    return keep


def drop_layers(model: Transformer, keep: list[int]) -> Transformer:
    """Keep only the decoder layers in ``keep`` (in place); returns ``model``."""
    model.layers = nn.ModuleList(model.layers[i] for i in keep)
    for j, layer in enumerate(model.layers):
        layer.self_attn.layer_idx = j  # the KV cache indexes layers by position
    model.config = copy.deepcopy(model.config)
    model.config.n_layers = len(keep)
    return model


def keep_layers_student(teacher: Transformer, keep: list[int]) -> Transformer:
    """A copy of ``teacher`` holding only the layers in ``keep``, initialised from the teacher's weights;
    trainable even when the teacher was frozen (a ``Distiller`` freezes its teacher)."""
    return drop_layers(copy.deepcopy(teacher), keep).requires_grad_(True)


def default_layer_map(n_student: int, n_teacher: int) -> list[tuple[int, int]]:
    """Student layer j matches teacher layer ``round((j + 1) * Lt / Ls) - 1``: the end of the span it stands for.

    For ``keep_layers`` every other layer this is teacher layer 2j+1, the output of the pair that
    student layer j replaces; for equal depths it is the identity.
    """
    return [(j, round((j + 1) * n_teacher / n_student) - 1) for j in range(n_student)]
