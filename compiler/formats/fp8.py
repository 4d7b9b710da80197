"""The ``fp8`` weight format (FP8 E4M3 / E5M2 weights, optional FP8 activations).

Primitives (choose a scale, quantize, dequantize, saturating casts) are in ``compiler/quant/fp8.py``.

The ``fp8`` format (``Fp8Linear``), buffers stored in the artifact under the module's name:

    weight        float8_e4m3fn | float8_e5m2  [out_features, in_features]
    weight_scale  float32  [out_features] (per_channel) or [1] (per_tensor);
                  W ≈ weight.float() * weight_scale[:, None]
    input_scale   float32  [1], only with activation_scheme = "static":
                  x ≈ saturate(x / input_scale).to(activation_dtype) * input_scale
    input_shift   float32  [in_features], only with input_shift = true: each input channel's mean
                  on calibration, subtracted before quantization (see below)
    bias          model dtype [out_features], when the layer has one or input_shift is set
    outlier_index  int64 [r], only with outlier_channels = r > 0: input channels kept out of FP8
    outlier_weight model dtype [out_features, r]: the weight's columns for those channels
                  (``weight``'s own columns there are zero)

``activation_scheme`` is ``dynamic`` (one scale per token, computed at run time from the
token's absolute maximum; with ``activation_group_size`` G > 0, one per G consecutive input
channels of a token, as DeepSeek-V3's 1×128 tiles, so a token's outlier channels no longer push
its other channels towards FP8's subnormals), ``static`` (the calibrated ``input_scale``) or
``none`` (weight-only: the weight is dequantized and multiplied in the model dtype).

With ``input_shift`` (Outlier Suppression+'s channel shift, Wei et al. 2023) the layer computes
``Ŵ·(x − μ) + b'`` with ``b' = b + W·μ`` from the float weight: FP8's rounding error is relative
to each value, so it is spent on ``x − μ`` instead of ``x``, and SmolLM2's outlier channels,
which sit far from zero with the same sign on most tokens, lose most of their error.

With ``outlier_channels`` (QUIK's mixed-precision split, Ashkboos et al. 2023; LLM.int8()'s with
channels fixed at calibration) the r input channels of largest calibrated mean square are left out
of the FP8 cast, so they neither take FP8's rounding nor set a token's scale, and go through a
small [M, r] × [r, out] matmul in the model dtype: ``y = fp8_gemm(x with those channels zeroed)
+ x[:, idx] @ outlier_weight.T + b'``.
"""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn as nn

from compiler.errors import ArtifactError
from compiler.formats.qlinear import QuantizedLinear, register_format
from compiler.kernels.fp8_gemm import fp8_gemm
from compiler.quant.fp8 import (
    MIN_SCALE,
    dequantize,
    fp8_dtype,
    quantize,
    quantize_per_token,
    quantize_per_token_group,
    weight_scale,
)


@register_format
class Fp8Linear(QuantizedLinear):
    """A Linear with FP8 weights and (optionally) FP8 activations; see the module docstring."""

    format_name: ClassVar[str] = "fp8"

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 weight_dtype: str = "float8_e4m3fn", granularity: str = "per_channel",
                 activation_dtype: str = "float8_e4m3fn", activation_scheme: str = "dynamic",
                 activation_group_size: int = 0, input_shift: bool = False, outlier_channels: int = 0):
        super().__init__()
        if not 0 <= outlier_channels < in_features:
            raise ValueError(f"outlier_channels must be in [0, in_features) = [0, {in_features}), got {outlier_channels}")
        if activation_group_size and (activation_scheme != "dynamic" or in_features % activation_group_size):
            raise ValueError(f"activation_group_size {activation_group_size} needs dynamic activations and must "
                             f"divide in_features ({in_features})")
        self.activation_group_size = activation_group_size
        self.in_features, self.out_features = in_features, out_features
        self.weight_dtype, self.granularity = weight_dtype, granularity
        self.activation_dtype, self.activation_scheme = activation_dtype, activation_scheme
        n_scales = out_features if granularity == "per_channel" else 1
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=fp8_dtype(weight_dtype)))
        self.register_buffer("weight_scale", torch.empty(n_scales, dtype=torch.float32))
        if activation_scheme == "static":
            self.register_buffer("input_scale", torch.empty(1, dtype=torch.float32))
        self.register_buffer("input_shift", torch.empty(in_features, dtype=torch.float32) if input_shift else None)
        bias = bias or input_shift  # W·μ goes into the bias
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)
        self.register_buffer("outlier_index", torch.empty(outlier_channels, dtype=torch.int64) if outlier_channels else None)
        self.register_buffer("outlier_weight", torch.empty(out_features, outlier_channels, dtype=dtype)
                             if outlier_channels else None)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) casts every floating buffer, FP8 codes and float32 scales included; the
        # cast to a wider float is exact, so restoring the storage dtypes afterwards loses nothing.
        super()._apply(fn, recurse)
        self.weight = self.weight.to(fp8_dtype(self.weight_dtype))
        self.weight_scale = self.weight_scale.float()
        if self.activation_scheme == "static":
            self.input_scale = self.input_scale.float()
        if self.input_shift is not None:
            self.input_shift = self.input_shift.float()
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight_dtype: str = "float8_e4m3fn", granularity: str = "per_channel",
                    activation_dtype: str = "float8_e4m3fn", activation_scheme: str = "dynamic",
                    input_scale: float | None = None, weight: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None, activation_group_size: int = 0,
                    input_shift: torch.Tensor | None = None, outliers: torch.Tensor | None = None) -> "Fp8Linear":
        """Quantize ``linear``'s weight; ``input_scale`` is required when activations are static.
        ``weight`` and ``scale`` replace the layer's weight and its abs-max scale (GPTQ rounds a
        compensated weight on the original weight's scales); ``input_shift`` [in_features] is
        subtracted from every input, its product with the float weight added to the bias;
        ``outliers`` (input channel indices) keep their columns of ``weight`` in the model dtype."""
        w = (linear.weight if weight is None else weight).detach()
        if activation_scheme == "static" and input_scale is None:
            raise ValueError("static activations need a calibrated input_scale")
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype,
                weight_dtype, granularity, activation_dtype, activation_scheme, activation_group_size,
                input_shift is not None, 0 if outliers is None else len(outliers)).to(w.device)
        wdt = fp8_dtype(weight_dtype)
        if outliers is not None:
            m.outlier_index.copy_(outliers)
            m.outlier_weight.copy_(w[:, outliers])
            w = w.index_fill(1, m.outlier_index, 0)
        scale = weight_scale(w, wdt, granularity) if scale is None else scale.float()
        m.weight.copy_(quantize(w, scale[:, None], wdt))
        m.weight_scale.copy_(scale)
        if activation_scheme == "static":
            m.input_scale.fill_(max(float(input_scale), MIN_SCALE))
        bias = None if linear.bias is None else linear.bias.detach().double()
        if input_shift is not None:
            m.input_shift.copy_(input_shift)
            shifted = linear.weight.detach().double() @ input_shift.double()
            bias = shifted if bias is None else bias + shifted
        if bias is not None:
            m.bias.copy_(bias)
        return m

    def format_meta(self) -> dict:
        meta = {"format": self.format_name, "in_features": self.in_features, "out_features": self.out_features,
                "weight_dtype": self.weight_dtype, "granularity": self.granularity,
                "activation_scheme": self.activation_scheme}
        if self.activation_scheme != "none":
            meta["activation_dtype"] = self.activation_dtype
        if self.activation_group_size:
            meta["activation_group_size"] = self.activation_group_size
        if self.input_shift is not None:
            meta["input_shift"] = True
        if self.outlier_index is not None:
            meta["outlier_channels"] = len(self.outlier_index)
        return meta

    @classmethod
    def empty(cls, meta: dict, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> "Fp8Linear":
        try:
            return cls(in_features, out_features, bias, dtype, meta["weight_dtype"], meta["granularity"],
                       meta.get("activation_dtype", "float8_e4m3fn"), meta["activation_scheme"],
                       meta.get("activation_group_size", 0), meta.get("input_shift", False),
                       meta.get("outlier_channels", 0))
        except KeyError as e:
            raise ArtifactError(f"fp8 module entry lacks {e}; the manifest is corrupt, recompile the artifact") from None

    def dequantized_weight(self) -> torch.Tensor:
        w = dequantize(self.weight, self.weight_scale[:, None])
        if self.outlier_index is not None:
            w[:, self.outlier_index] = self.outlier_weight.float()
        return w

    def dequantized_bias(self) -> torch.Tensor | None:
        if self.input_shift is None:
            return self.bias
        return (self.bias.float() - self.dequantized_weight() @ self.input_shift).to(self.bias.dtype)

    def _outlier_part(self, x: torch.Tensor) -> torch.Tensor:
        """The outlier channels' share of the output, in the model dtype: x[:, idx] (centred) @ W[:, idx].T."""
        x = x[:, self.outlier_index]
        if self.input_shift is not None:
            x = x.float() - self.input_shift[self.outlier_index]
        return x.to(self.outlier_weight.dtype) @ self.outlier_weight.t()

    def _centred(self, x: torch.Tensor) -> torch.Tensor:
        """x less ``input_shift`` (in float32), or x itself without one."""
        return x if self.input_shift is None else x.float() - self.input_shift

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] (less ``input_shift``, in float32, outlier channels zeroed) -> FP8 codes [M, K]
        and scales [M] (dynamic), [M, K / G] (dynamic with groups of G channels) or [1] (static)."""
        dtype = fp8_dtype(self.activation_dtype)
        static = self.activation_scheme == "static"
        per_row = quantize_per_token
        if x.is_cuda:
            from compiler.kernels.fp8 import triton_quantize_rows as per_row
            if not self.activation_group_size and self.outlier_index is None:
                # one fused kernel (shift, scale, cast) instead of six torch ones
                return per_row(x, dtype, self.input_scale if static else None, shift=self.input_shift)
        x = self._centred(x)
        if self.outlier_index is not None:
            x = x.index_fill(1, self.outlier_index, 0)
        if static:
            return quantize(x, self.input_scale, dtype), self.input_scale
        if self.activation_group_size:
            return quantize_per_token_group(x, dtype, self.activation_group_size, per_row)
        return per_row(x, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if self.activation_scheme == "none":
            y = self._centred(x2).to(x.dtype) @ self.dequantized_weight().to(x.dtype).t()
            y = y + self.bias if self.bias is not None else y
        else:
            xq, xs = self.quantize_input(x2)
            y = fp8_gemm(xq, xs, self.weight, self.weight_scale, self.bias, x.dtype)
            if self.outlier_index is not None:
                y = y + self._outlier_part(x2)
        return y.reshape(*shape[:-1], self.out_features)
