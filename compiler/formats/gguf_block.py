"""llama.cpp block-quantized weights (``format = "gguf"``): what the awq pass makes with
``format = "gguf:q4_0|q4_1|q4_k|q4_k_m"`` and ``qcompile lower --target gguf`` writes unchanged.

    K = in_features padded to a multiple of the block type's super-block (zero columns)
    codes   uint8 [N, K]              one code per weight, unpacked (the file packs them)
    d       float16 [N, K / super]    the super-block (q4_k, q6_k) or block scale
    m       float16 [N, K / 32]       q4_1: the block's minimum
    dmin    float16 [N, K / 256]      q4_k: the super-block's min scale
    sc      uint8 / int8 [N, K / sub] q4_k: 6-bit scale codes; q6_k: int8 scale codes
    mn      uint8 [N, K / 32]         q4_k: 6-bit min codes
    bias    dtype [N]                 optional (llama.cpp keeps biases in float)

The weight is ``compiler.quant.gguf_blocks``' ``codes * scale + offset``, llama.cpp's own
dequantization, so the artifact, its engine run and the GGUF file hold one set of weights.
The engine runs it by that dequantized weight (kept, never saved) and a float matmul: these are
llama.cpp's formats, served fastest by llama.cpp (``qcompile serve FILE.gguf --engine llama.cpp``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from compiler.formats.qlinear import QuantizedLinear, register_format
from compiler.kernels.dense_cpu import DerivedTensor
from compiler.quant.gguf_blocks import BLOCK_TYPES, BlockType

# The stored fields of each type: name -> (dtype, weights per entry).
FIELDS = {
    "q4_0": {"d": (torch.float16, 32)},
    "q5_0": {"d": (torch.float16, 32)},
    "q8_0": {"d": (torch.float16, 32)},
    "q4_1": {"d": (torch.float16, 32), "m": (torch.float16, 32)},
    "q4_k": {"d": (torch.float16, 256), "dmin": (torch.float16, 256), "sc": (torch.uint8, 32), "mn": (torch.uint8, 32)},
    "q6_k": {"d": (torch.float16, 256), "sc": (torch.int8, 16)},
}


@register_format
class GgufLinear(QuantizedLinear):
    """A linear layer stored in one llama.cpp block type (the layout above)."""

    format_name = "gguf"

    def __init__(self, in_features: int, block_type: str, codes: torch.Tensor, fields: dict[str, torch.Tensor],
                 bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, codes.shape[0]
        self.block_type = block_type
        self.register_buffer("codes", codes)
        for name in FIELDS[block_type]:
            self.register_buffer(name, fields[name])
        self.register_buffer("bias", bias)
        self._weight = DerivedTensor()  # never saved: see weight()

    @property
    def type(self) -> BlockType:
        return BLOCK_TYPES[self.block_type]

    @classmethod
    def from_codes(cls, codes: torch.Tensor, fields: dict[str, torch.Tensor], block_type: str, in_features: int,
                   bias: torch.Tensor | None) -> "GgufLinear":
        return cls(in_features, block_type, codes, fields, None if bias is None else bias.detach().clone())

    @classmethod
    def from_float(cls, linear: torch.nn.Linear, block_type: str, clip: torch.Tensor | float = 1.0) -> "GgufLinear":
        """Round-to-nearest onto ``block_type``'s grid (K zero-padded to its super-block)."""
        t = BLOCK_TYPES[block_type]
        w = pad_to_super(linear.weight.detach().float(), t)
        fields = t.choose(w, clip)
        return cls.from_codes(t.quantize(w, fields), fields, block_type, linear.in_features, linear.bias)

    def fields(self) -> dict[str, torch.Tensor]:
        return {name: self._buffers[name] for name in FIELDS[self.block_type]}

    def format_meta(self) -> dict:
        return {"format": self.format_name, "block_type": self.block_type, "in_features": self.in_features,
                "out_features": self.out_features, "padded_in_features": self.codes.shape[1]}

    @classmethod
    def empty(cls, meta, in_features, out_features, bias, dtype):
        t = BLOCK_TYPES[meta["block_type"]]
        k = math.ceil(in_features / t.super) * t.super
        fields = {name: torch.empty(out_features, k // per, dtype=fdtype) for name, (fdtype, per) in FIELDS[t.name].items()}
        return cls(in_features, t.name, torch.empty(out_features, k, dtype=torch.uint8), fields,
                   torch.empty(out_features, dtype=dtype) if bias else None)

    def dequantized_weight(self) -> torch.Tensor:
        return self.type.dequantize(self.codes, self.fields())[:, : self.in_features]

    def weight(self) -> torch.Tensor:
        """``dequantized_weight()``, kept until a buffer changes."""
        sources = (self._buffers["codes"], *self.fields().values())
        return self._weight.get(sources, self.dequantized_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block_type={self.block_type}"


def pad_to_super(w: torch.Tensor, t: BlockType) -> torch.Tensor:
    pad = (-w.shape[-1]) % t.super
    return F.pad(w, (0, pad)) if pad else w
