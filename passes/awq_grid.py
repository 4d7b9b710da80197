"""The grid a layer is quantized onto, for AWQ's searches and its final rounding.

The scale search, the clip search and GPTQ's rounding need three things of a format: its fake
quantization of a weight under a clip ratio per block (``fake_quantize``), its block width
(``block``: the clip search's unit), and the module it stores the chosen codes in (``module``).
``Int4Grid`` is qcompile's INT4 (group size, zero point: ``Int4Linear``); ``GgufGrid`` one of
llama.cpp's block types (``GgufLinear``), so that with ``format = "gguf:q4_k"`` every search
scores, and GPTQ rounds onto, exactly the grid the GGUF file holds; ``Int8Grid`` INT8 per output
channel (``Int8Linear`` W8A16), the wider candidate of ``average_bits``. The INT grids also re-fit
their scales to the chosen codes (``refit``, the ``scale_refit`` option).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import torch.nn.functional as F

from compiler.formats.gguf_block import GgufLinear, pad_to_super
from compiler.formats.int4 import Int4Linear
from compiler.formats.int8 import Int8Format, Int8Linear
from compiler.quant.gguf_blocks import BLOCK_TYPES, BlockType
from compiler.quant.int4 import pad_columns, storage_scale
from compiler.quant.int8 import dequantize_weight, quantize_weight, weight_scale
from passes.awq_search import fast_fake_quantize, refit_scales
from passes.gptq import gptq_int4, gptq_round


@dataclass(frozen=True)
class Int4Grid:
    group_size: int
    zero_point: bool

    @property
    def block(self) -> int:
        return self.group_size

    def pad(self, w: torch.Tensor) -> torch.Tensor:
        return pad_columns(w, self.group_size)

    def fake_quantize(self, w: torch.Tensor, clip_ratio=1.0) -> torch.Tensor:
        return fast_fake_quantize(w, self.group_size, self.zero_point, clip_ratio)

    def module(self, linear: torch.nn.Linear, clip, hessian: torch.Tensor | None, damp: float) -> Int4Linear:
        """The layer on this grid: round-to-nearest (``hessian`` None) or GPTQ's rounding over ``hessian``."""
        if hessian is None:
            return Int4Linear.from_float(linear, self.group_size, self.zero_point, clip)
        return gptq_int4(linear, hessian, self.group_size, self.zero_point, clip, damp)

    def refit(self, module: Int4Linear, weight: torch.Tensor, hessian: torch.Tensor) -> None:
        """Least-squares scales on the module's codes and zero points (``refit_scales``), in place."""
        q, zero = module.codes()
        levels = q.float() - zero.float().repeat_interleave(self.group_size, dim=1)
        pad = levels.shape[1] - hessian.shape[0]
        module.scales.copy_(refit_scales(self.pad(weight), levels, module.scales, F.pad(hessian, (0, pad, 0, pad)),
                                         lambda s: storage_scale(s, module.scales.dtype)))


@dataclass(frozen=True)
class Int8Grid:
    """INT8 codes per output channel, weight-only (W8A16). The scales are float16 values, as INT4's
    (``storage_scale``), so that vLLM's float16 checkpoint and GGUF's Q8_0 blocks hold them exactly."""

    def module(self, linear: torch.nn.Linear, clip, hessian: torch.Tensor | None, damp: float) -> Int8Linear:
        """The layer on this grid (``clip`` unused: the abs-max scale): RTN, or GPTQ's rounding over ``hessian``."""
        scale = storage_scale(weight_scale(linear.weight), torch.float32)
        weight = None if hessian is None else gptq_round(
            linear.weight, hessian, lambda cols, _: dequantize_weight(quantize_weight(cols, scale), scale), damp=damp)
        return Int8Linear.from_linear(linear, Int8Format.for_linear(linear, activation_scheme="none"), weight,
                                      scale=scale)

    def refit(self, module: Int8Linear, weight: torch.Tensor, hessian: torch.Tensor) -> None:
        """Least-squares scale of each row on its codes (``refit_scales``, one block per row), in place."""
        scale = module.weight_scale[:, None]
        scale.copy_(refit_scales(weight, module.weight.float(), scale, hessian,
                                 lambda s: storage_scale(s, torch.float32)))


@dataclass(frozen=True)
class GgufGrid:
    block_type: str

    @property
    def type(self) -> BlockType:
        return BLOCK_TYPES[self.block_type]

    @property
    def block(self) -> int:
        return self.type.sub

    def pad(self, w: torch.Tensor) -> torch.Tensor:
        return pad_to_super(w, self.type)

    def fake_quantize(self, w: torch.Tensor, clip_ratio=1.0) -> torch.Tensor:
        return self.type.fake_quantize(w, clip_ratio)

    def module(self, linear: torch.nn.Linear, clip, hessian: torch.Tensor | None, damp: float) -> GgufLinear:
        """The layer on this block type: round-to-nearest, or GPTQ's rounding on the fields the clipped
        range chose (each column rounded onto its sub-block's q * scale + offset)."""
        if hessian is None:
            return GgufLinear.from_float(linear, self.block_type, clip)
        t = self.type
        w = pad_to_super(linear.weight.detach().float(), t)
        fields = t.choose(w, clip)
        scale, offset = t.scale_offset(fields)
        pad = w.shape[1] - hessian.shape[0]  # padded columns never see an input: GPTQ treats them as dead
        h = torch.nn.functional.pad(hessian, (0, pad, 0, pad))
        rounded = gptq_round(w, h, _round_onto(scale, offset, t.qmax, t.sub), damp=damp)
        return GgufLinear.from_codes(t.quantize(rounded, fields), fields, self.block_type, linear.in_features, linear.bias)


def _round_onto(scale: torch.Tensor, offset: torch.Tensor, qmax: int, block: int):
    """GPTQ's ``round_columns`` onto q * scale + offset, q in [0, qmax], per block of columns."""
    def round_columns(values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        s, c = scale[:, columns // block], offset[:, columns // block]
        q = torch.where(s == 0, torch.zeros_like(values), (values - c) / torch.where(s == 0, 1.0, s))
        return q.round().clamp(0, qmax).mul(s).add(c)

    return round_columns


def grid_of(block_type: str | None, group_size: int, zero_point: bool) -> Int4Grid | GgufGrid:
    return GgufGrid(block_type) if block_type else Int4Grid(group_size, zero_point)
