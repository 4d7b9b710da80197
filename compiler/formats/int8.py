"""The ``int8`` weight format: INT8 weights per output channel, with INT8 activations (W8A8) or
without (W8A16). Primitives: ``compiler/quant/int8.py``; the CPU kernel: ``compiler/kernels/w8a8_cpu.py``.

``Int8Linear`` is built from an ``Int8Format`` (its ``to_dict()`` is the module's manifest entry).
Buffers, stored in the artifact under the module's name:

    weight            int8     [out_features, in_features]   symmetric codes, -127..127
    weight_scale      float32  [out_features]                W ≈ weight.float() * weight_scale[:, None]
    input_scale       float32  [1], only with activation_scheme = "static"
    input_zero_point  int32    [1], only with static asymmetric activations
    bias              model dtype [out_features], when the layer has one

``activation_scheme``: ``dynamic`` (a scale, and with ``activation_symmetric = false`` a zero point,
per token at run time), ``static`` (the calibrated ``input_scale`` / ``input_zero_point`` per tensor)
or ``none`` (W8A16: the weight is dequantized and multiplied in the model dtype). The layer's output
is exactly ``compiler/quant/int8.py``'s ``int8_gemm`` of its quantized input, by the C++ kernel on
the CPU (the same bits) or by torch elsewhere; compressed-tensors' ``int-quantized`` scheme and
msModelSlim's W8A8 / W8A8_DYNAMIC / W8A16 store these tensors as they are.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from compiler.errors import ArtifactError
from compiler.formats.qlinear import QuantizedLinear, register_format
from compiler.kernels.dense_cpu import DerivedTensor
from compiler.kernels.w8a8_cpu import pack_w8a8, w8a8_matmul, w8a8_unavailable_reason
from compiler.quant.int8 import (
    dequantize_weight,
    int8_gemm,
    quantize_activations,
    quantize_per_token,
    quantize_weight,
    weight_scale,
)

ACTIVATION_SCHEMES = ("dynamic", "static", "none")


@dataclass(frozen=True, kw_only=True)
class Int8Format:
    """One ``int8`` module's format; ``to_dict()`` is its manifest entry, ``from_dict`` reads one
    back (``ArtifactError``, one line, when malformed)."""

    in_features: int
    out_features: int
    activation_scheme: Literal["dynamic", "static", "none"] = "dynamic"
    activation_symmetric: bool = True  # False: a zero point per token (dynamic) or per tensor (static)

    def __post_init__(self):
        for name, kind in (("in_features", int), ("out_features", int), ("activation_symmetric", bool)):
            if type(getattr(self, name)) is not kind:
                raise ValueError(f"{name} must be {kind.__name__}, got {getattr(self, name)!r}")
        if self.activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"activation_scheme must be one of {', '.join(ACTIVATION_SCHEMES)}, "
                             f"got {self.activation_scheme!r}")
        if self.in_features < 1 or self.out_features < 1:
            raise ValueError(f"in_features and out_features must be >= 1, got {self.in_features}, {self.out_features}")
        if self.activation_scheme == "none" and not self.activation_symmetric:
            raise ValueError("activation_symmetric = false needs INT8 activations (dynamic or static), not W8A16")

    @classmethod
    def for_linear(cls, linear: nn.Linear, **behaviour) -> "Int8Format":
        return cls(in_features=linear.in_features, out_features=linear.out_features, **behaviour)

    @property
    def quantizes_activations(self) -> bool:
        return self.activation_scheme != "none"

    @property
    def static(self) -> bool:
        return self.activation_scheme == "static"

    @property
    def scheme(self) -> str:
        """"W8A8" (dynamic or static) or "W8A16", as the exports name it."""
        return "W8A8" if self.quantizes_activations else "W8A16"

    def to_dict(self) -> dict:
        return {"format": Int8Linear.format_name, "in_features": self.in_features, "out_features": self.out_features,
                "activation_scheme": self.activation_scheme, "activation_symmetric": self.activation_symmetric}

    @classmethod
    def from_dict(cls, meta: dict) -> "Int8Format":
        known = {f.name for f in fields(cls)} | {"format"}
        unknown = sorted(set(meta) - known)
        if meta.get("format") != Int8Linear.format_name or unknown:
            what = f"unknown keys {unknown}" if unknown else f"format {meta.get('format')!r}"
            raise ArtifactError(f"int8 module entry has {what}; the artifact is from a newer qcompile or corrupt")
        if missing := [k for k in ("in_features", "out_features", "activation_scheme") if k not in meta]:
            raise ArtifactError(f"int8 module entry lacks {', '.join(missing)}; the manifest is corrupt, "
                                "recompile the artifact")
        try:
            return cls(**{k: v for k, v in meta.items() if k != "format"})
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"int8 module entry is invalid ({e}); the manifest is corrupt, "
                                "recompile the artifact") from None


@register_format
class Int8Linear(QuantizedLinear):
    """A Linear with INT8 weights per output channel and INT8 (W8A8) or float (W8A16) activations;
    see the module docstring for its buffers."""

    format_name: ClassVar[str] = "int8"

    def __init__(self, fmt: Int8Format, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.format = fmt
        k, n = fmt.in_features, fmt.out_features
        self.in_features, self.out_features = k, n
        self.register_buffer("weight", torch.empty(n, k, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(n, dtype=torch.float32))
        self.register_buffer("input_scale", torch.empty(1, dtype=torch.float32) if fmt.static else None)
        asymmetric_static = fmt.static and not fmt.activation_symmetric
        self.register_buffer("input_zero_point", torch.empty(1, dtype=torch.int32) if asymmetric_static else None)
        self.register_buffer("bias", torch.empty(n, dtype=dtype) if bias else None)
        self._pack = DerivedTensor()  # the kernel's layout of ``weight`` (never saved)
        self._float_weight = DerivedTensor()  # W8A16's dequantized weight in the model dtype (never saved)
        self._float_bias = DerivedTensor()  # the bias in float32, as the kernel takes it (never saved)

    @property
    def quantizes_activations(self) -> bool:
        return self.format.quantizes_activations

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) casts floating buffers: keep the scales float32 (the codes are int8 already).
        super()._apply(fn, recurse)
        for name in ("weight_scale", "input_scale"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).float())
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: Int8Format | None = None, weight: torch.Tensor | None = None,
                    input_qparams: tuple[float, int | None] | None = None,
                    scale: torch.Tensor | None = None) -> "Int8Linear":
        """Quantize ``linear`` into ``fmt`` (default dynamic symmetric W8A8). ``weight`` replaces the
        layer's weight on the grid of the original weight's scales (GPTQ's compensated weight);
        ``input_qparams`` (scale, zero point or None) are a static format's calibrated ones; ``scale``
        [N] replaces the abs-max weight scales (the awq pass's float16-valued ones)."""
        fmt = fmt or Int8Format.for_linear(linear)
        if (fmt.in_features, fmt.out_features) != (linear.in_features, linear.out_features):
            raise ValueError(f"format is {fmt.in_features} -> {fmt.out_features}, the linear "
                             f"{linear.in_features} -> {linear.out_features}")
        if fmt.static != (input_qparams is not None):
            raise ValueError("pass input_qparams exactly when the format's activations are static")
        scale = weight_scale(linear.weight) if scale is None else scale.float()
        m = cls(fmt, linear.bias is not None, linear.weight.dtype).to(linear.weight.device)
        m.weight.copy_(quantize_weight((linear.weight if weight is None else weight).detach(), scale))
        m.weight_scale.copy_(scale)
        if fmt.static:
            m.input_scale.fill_(float(input_qparams[0]))
            if m.input_zero_point is not None:
                m.input_zero_point.fill_(int(input_qparams[1]))
        if linear.bias is not None:
            m.bias.copy_(linear.bias.detach())
        return m

    def format_meta(self) -> dict:
        return self.format.to_dict()

    @classmethod
    def empty(cls, meta: dict, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> "Int8Linear":
        fmt = Int8Format.from_dict(meta)
        if (fmt.in_features, fmt.out_features) != (in_features, out_features):
            raise ArtifactError(f"int8 module entry is {fmt.in_features} -> {fmt.out_features}, the model's layer "
                                f"{in_features} -> {out_features}; the manifest is corrupt, recompile the artifact")
        return cls(fmt, bias, dtype)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_weight(self.weight, self.weight_scale)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [M, K] -> (int8 codes [M, K], scales [M, 1] or [1], zero points or None)."""
        if self.format.static:
            return quantize_activations(x, self.input_scale, self.input_zero_point), self.input_scale, self.input_zero_point
        return quantize_per_token(x, self.format.activation_symmetric)

    def pack_cpu_weight(self) -> bool:
        """Build the kernel's layout now (the engine's ``pack_linears``, at load); False where
        the CPU forward does not take it."""
        if not (self.weight.is_cpu and self.quantizes_activations and w8a8_unavailable_reason() is None):
            return False
        self._packed()
        return True

    def _packed(self):
        return self._pack.get((self.weight,), lambda: pack_w8a8(self.weight))

    def drop_derived(self) -> None:
        """Free the derived copies (rebuilt on the next forward)."""
        self._pack.drop()
        self._float_weight.drop()
        self._float_bias.drop()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if not self.quantizes_activations:
            w = self._float_weight.get((self.weight, self.weight_scale), lambda: self.dequantized_weight().to(x.dtype))
            y = F.linear(x2, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))  # .to: free when equal
        elif x.is_cpu and w8a8_unavailable_reason() is None:
            fmt = self.format
            bias = None if self.bias is None else self._float_bias.get((self.bias,), lambda: self.bias.float())
            y = w8a8_matmul(x2, self._packed(), self.weight_scale, bias,
                            input_scale=self.input_scale, input_zero_point=self.input_zero_point,
                            symmetric=fmt.activation_symmetric)
        else:
            y = self.reference_forward(x2)
        return y.reshape(*shape[:-1], self.out_features)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """torch's arithmetic of the format (the kernel's bits): quantize the input, integer GEMM, scale."""
        x2 = x.reshape(-1, self.in_features)
        y = int8_gemm(*self.quantize_input(x2), self.weight, self.weight_scale, self.bias)
        if self.format.static:  # a static scale would clamp inf to a finite code: NaN rows, as the kernel
            y = torch.where(torch.isfinite(x2).all(dim=1, keepdim=True), y, torch.full_like(y, float("nan")))
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
