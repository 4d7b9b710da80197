"""The ``fp8`` weight format (FP8 E4M3 / E5M2 weights, optional FP8 activations).

Primitives (choose a scale, quantize, dequantize, saturating casts) are in ``compiler/quant/fp8.py``.

The ``fp8`` format: ``Fp8Linear``, built from an ``Fp8Format`` (a frozen dataclass whose
``to_dict()`` is the module's manifest entry). Buffers, stored in the artifact under the module's name:

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

from dataclasses import dataclass, fields
from typing import ClassVar, Literal

import torch
import torch.nn as nn

from compiler.errors import ArtifactError
from compiler.formats.qlinear import QuantizedLinear, register_format
from compiler.kernels.cpu_ext import cpu_kernels, pack_fp8_codes
from compiler.kernels.dense_cpu import DerivedTensor, pack_weight, packing_available
from compiler.kernels.dispatch import (
    FP8_CODES,
    FP8_FLOAT_COPY,
    FP8_FLOAT_COPY_CALL,
    FP8_GEMM,
    FP8_WEIGHT_ONLY,
    fp8_kernel,
    packed_from_rows,
)
from compiler.kernels.fp8_gemm import (
    dequantize_activations,
    dequantize_weight,
    float_gemm,
    fp8_gemm,
)
from compiler.quant.fp8 import (
    FP8_DTYPES,
    MIN_SCALE,
    Fp8DtypeName,
    dequantize,
    quantize,
    quantize_per_token,
    quantize_per_token_group,
    weight_scale,
)

GRANULARITIES = ("per_channel", "per_tensor")
ACTIVATION_SCHEMES = ("dynamic", "static", "none")
# Every manifest entry has written these; the others are left out at their default.
_REQUIRED = ("in_features", "out_features", "weight_dtype", "granularity", "activation_scheme")


@dataclass(frozen=True, kw_only=True)
class Fp8Format:
    """One ``fp8`` module's format: what ``Fp8Linear`` is built from and, as ``to_dict()``, its
    manifest entry (``Fp8Format(in_features=576, out_features=1536).to_dict()`` ==
    ``{"format": "fp8", "in_features": 576, "out_features": 1536, "weight_dtype": "float8_e4m3fn",
    "granularity": "per_channel", "activation_scheme": "dynamic", "activation_dtype": "float8_e4m3fn"}``).
    Validates itself (``ValueError``); ``from_dict`` reads an entry back (``ArtifactError``).
    """

    in_features: int
    out_features: int
    weight_dtype: Fp8DtypeName = "float8_e4m3fn"
    granularity: Literal["per_channel", "per_tensor"] = "per_channel"
    activation_scheme: Literal["dynamic", "static", "none"] = "dynamic"
    activation_dtype: Fp8DtypeName = "float8_e4m3fn"  # unused (and not written) with activation_scheme "none"
    activation_group_size: int = 0  # dynamic: one scale per token (0) or per token and this many channels
    input_shift: bool = False  # an input_shift buffer is subtracted from every input
    outlier_channels: int = 0  # this many input channels bypass FP8 (outlier_index, outlier_weight)

    def __post_init__(self):
        for name, kind in (("in_features", int), ("out_features", int), ("activation_group_size", int),
                           ("outlier_channels", int), ("input_shift", bool)):
            if type(getattr(self, name)) is not kind:
                raise ValueError(f"{name} must be {kind.__name__}, got {getattr(self, name)!r}")
        for name, allowed in (("weight_dtype", FP8_DTYPES), ("activation_dtype", FP8_DTYPES),
                              ("granularity", GRANULARITIES), ("activation_scheme", ACTIVATION_SCHEMES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.in_features < 1 or self.out_features < 1:
            raise ValueError(f"in_features and out_features must be >= 1, got {self.in_features}, {self.out_features}")
        if not 0 <= self.outlier_channels < self.in_features:
            raise ValueError(f"outlier_channels must be in [0, in_features) = [0, {self.in_features}), "
                             f"got {self.outlier_channels}")
        g = self.activation_group_size
        if g < 0 or g and (not self.dynamic or self.in_features % g):
            raise ValueError(f"activation_group_size {g} needs dynamic activations and must divide in_features "
                             f"({self.in_features})")
        if not self.quantizes_activations:  # meaningless without FP8 activations, and not written
            object.__setattr__(self, "activation_dtype", "float8_e4m3fn")

    @classmethod
    def for_linear(cls, linear: nn.Linear, **behaviour) -> "Fp8Format":
        """The format of ``linear``'s shape with ``behaviour`` (the other fields) set."""
        return cls(in_features=linear.in_features, out_features=linear.out_features, **behaviour)

    @property
    def quantizes_activations(self) -> bool:
        """FP8 activations (dynamic or static); False: weight-only."""
        return self.activation_scheme != "none"

    @property
    def dynamic(self) -> bool:
        """Activation scales computed per token at run time."""
        return self.activation_scheme == "dynamic"

    @property
    def static(self) -> bool:
        """One calibrated activation scale (the ``input_scale`` buffer)."""
        return self.activation_scheme == "static"

    @property
    def weight_torch_dtype(self) -> torch.dtype:
        return FP8_DTYPES[self.weight_dtype]

    @property
    def activation_torch_dtype(self) -> torch.dtype:
        return FP8_DTYPES[self.activation_dtype]

    @property
    def weight_scales(self) -> int:
        """How many weight scales: one per output row, or one."""
        return self.out_features if self.granularity == "per_channel" else 1

    def to_dict(self) -> dict:
        """The manifest entry; fields at their default are left out where older artifacts lack them."""
        d = {"format": Fp8Linear.format_name, "in_features": self.in_features, "out_features": self.out_features,
             "weight_dtype": self.weight_dtype, "granularity": self.granularity,
             "activation_scheme": self.activation_scheme}
        if self.quantizes_activations:
            d["activation_dtype"] = self.activation_dtype
        if self.activation_group_size:
            d["activation_group_size"] = self.activation_group_size
        if self.input_shift:
            d["input_shift"] = True
        if self.outlier_channels:
            d["outlier_channels"] = self.outlier_channels
        return d

    @classmethod
    def from_dict(cls, meta: dict) -> "Fp8Format":
        """The format of a manifest entry; ``ArtifactError`` (one line) when it is malformed."""
        known = {f.name for f in fields(cls)} | {"format"}
        unknown = sorted(set(meta) - known)
        if meta.get("format") != Fp8Linear.format_name or unknown:
            what = f"unknown keys {unknown}" if unknown else f"format {meta.get('format')!r}"
            raise ArtifactError(f"fp8 module entry has {what}; the artifact is from a newer qcompile or corrupt")
        missing = [k for k in _REQUIRED if k not in meta]
        if missing:
            raise ArtifactError(f"fp8 module entry lacks {', '.join(missing)}; the manifest is corrupt, recompile the artifact")
        try:
            return cls(**{k: v for k, v in meta.items() if k != "format"})
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"fp8 module entry is invalid ({e}); the manifest is corrupt, recompile the artifact") from None


@register_format
class Fp8Linear(QuantizedLinear):
    """A Linear with FP8 weights and (optionally) FP8 activations, built from an ``Fp8Format``;
    see the module docstring for its buffers."""

    format_name: ClassVar[str] = "fp8"

    def __init__(self, fmt: Fp8Format, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.format = fmt
        k, n, r = fmt.in_features, fmt.out_features, fmt.outlier_channels
        self.in_features, self.out_features = k, n
        self.register_buffer("weight", torch.empty(n, k, dtype=fmt.weight_torch_dtype))
        self.register_buffer("weight_scale", torch.empty(fmt.weight_scales, dtype=torch.float32))
        self.register_buffer("input_scale", torch.empty(1, dtype=torch.float32) if fmt.static else None)
        self.register_buffer("input_shift", torch.empty(k, dtype=torch.float32) if fmt.input_shift else None)
        bias = bias or fmt.input_shift  # W·μ goes into the bias
        self.register_buffer("bias", torch.empty(n, dtype=dtype) if bias else None)
        self.register_buffer("outlier_index", torch.empty(r, dtype=torch.int64) if r else None)
        self.register_buffer("outlier_weight", torch.empty(n, r, dtype=dtype) if r else None)
        self._float_weight = DerivedTensor()  # never saved: see float_weight()
        self._packed_weight: DerivedTensor | None = None  # float_weight() packed (dense_cpu.pack_weight), once pack_cpu_weight() is called
        self._cpu_codes = DerivedTensor()  # never saved: see cpu_codes()

    @property
    def quantizes_activations(self) -> bool:
        return self.format.quantizes_activations

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) casts every floating buffer, FP8 codes and float32 scales included; the
        # cast to a wider float is exact, so restoring the storage dtypes afterwards loses nothing.
        super()._apply(fn, recurse)
        self.weight = self.weight.to(self.format.weight_torch_dtype)
        for name in ("weight_scale", "input_scale", "input_shift"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).float())
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: Fp8Format | None = None, input_scale: float | None = None,
                    weight: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                    input_shift: torch.Tensor | None = None, outliers: torch.Tensor | None = None) -> "Fp8Linear":
        """Quantize ``linear``'s weight into ``fmt`` (default: ``Fp8Format.for_linear(linear)``,
        dynamic E4M3 per channel). ``input_scale`` is required when activations are static;
        ``weight`` and ``scale`` replace the layer's weight and its abs-max scale (GPTQ rounds a
        compensated weight on the original weight's scales); ``input_shift`` [in_features] (with
        ``fmt.input_shift``) is subtracted from every input, its product with the float weight
        added to the bias; ``outliers`` (``fmt.outlier_channels`` input channel indices) keep
        their columns of ``weight`` in the model dtype."""
        fmt = fmt or Fp8Format.for_linear(linear)
        if (fmt.in_features, fmt.out_features) != (linear.in_features, linear.out_features):
            raise ValueError(f"format is {fmt.in_features} -> {fmt.out_features}, the linear "
                             f"{linear.in_features} -> {linear.out_features}")
        if fmt.static and input_scale is None:
            raise ValueError("static activations need a calibrated input_scale")
        if fmt.input_shift != (input_shift is not None):
            raise ValueError("pass input_shift exactly when the format has input_shift")
        if fmt.outlier_channels != (0 if outliers is None else len(outliers)):
            raise ValueError(f"the format keeps {fmt.outlier_channels} outlier channels; pass that many indices")
        w = (linear.weight if weight is None else weight).detach()
        m = cls(fmt, linear.bias is not None, w.dtype).to(w.device)
        if outliers is not None:
            m.outlier_index.copy_(outliers)
            m.outlier_weight.copy_(w[:, outliers])
            w = w.index_fill(1, m.outlier_index, 0)
        wdt = fmt.weight_torch_dtype
        scale = weight_scale(w, wdt, fmt.granularity) if scale is None else scale.float()
        m.weight.copy_(quantize(w, scale[:, None], wdt))
        m.weight_scale.copy_(scale)
        if fmt.static:
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
        return self.format.to_dict()

    @classmethod
    def empty(cls, meta: dict, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> "Fp8Linear":
        fmt = Fp8Format.from_dict(meta)
        if (fmt.in_features, fmt.out_features) != (in_features, out_features):
            raise ArtifactError(f"fp8 module entry is {fmt.in_features} -> {fmt.out_features}, the model's layer "
                                f"{in_features} -> {out_features}; the manifest is corrupt, recompile the artifact")
        return cls(fmt, bias, dtype)

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
        fmt = self.format
        dtype, static = fmt.activation_torch_dtype, fmt.static
        per_row = quantize_per_token
        if x.is_cuda:
            from compiler.kernels.fp8 import triton_quantize_rows as per_row
            if not fmt.activation_group_size and self.outlier_index is None:
                # one fused kernel (shift, scale, cast) instead of six torch ones
                return per_row(x, dtype, self.input_scale if static else None, shift=self.input_shift)
        x = self._centred(x)
        if self.outlier_index is not None:
            x = x.index_fill(1, self.outlier_index, 0)
        if static:
            return quantize(x, self.input_scale, dtype), self.input_scale
        if fmt.activation_group_size:
            return quantize_per_token_group(x, dtype, fmt.activation_group_size, per_row)
        return per_row(x, dtype)

    def cpu_activations(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> float32 [M, K]: the activations the dequantize reference multiplies by the
        float32 weight (less ``input_shift``, outlier channels zeroed, rounded through FP8 by their
        scale), by the C++ op where it runs (one op, the same bits), else by ``quantize_input``."""
        ops = cpu_kernels()
        if ops is None or self.format.activation_group_size:
            return dequantize_activations(*self.quantize_input(x))
        shift = self.input_shift
        x = x.float()
        if self.outlier_index is not None:
            x, shift = self._centred(x).index_fill(1, self.outlier_index, 0), None
        return ops.fp8_fake_quant_rows(x.contiguous(), shift, self.input_scale, self.format.activation_torch_dtype)[0]

    def float_weight(self) -> torch.Tensor:
        """The float32 weight a CPU forward multiplies by, built on first use and again whenever a
        buffer is replaced or written in place: with FP8 activations the dequantized codes (the
        reference's ``dequantize_weight``), weight-only ``dequantized_weight()`` (outlier columns in).
        A derived copy, never saved: 4 bytes per weight (``compiler/kernels/fp8_gemm.py``)."""
        def build():
            if self.format.quantizes_activations:
                return dequantize_weight(self.weight, self.weight_scale)
            return self.dequantized_weight()

        return self._float_weight.get((self.weight, self.weight_scale, self.outlier_weight), build)

    def cpu_codes(self) -> torch.Tensor:
        """The FP8 codes in ``fp8_linear_codes``' layout (``pack_fp8_codes``: 1 byte per weight, the
        codes themselves rearranged), built on first use and again whenever ``weight`` is replaced
        or written in place; never saved."""
        return self._cpu_codes.get((self.weight,), lambda: pack_fp8_codes(self.weight))

    def drop_float_weight(self) -> None:
        """Free the derived copies (rebuilt on the next CPU forward): a compile measures a layer's
        error through one, then must not keep it for every converted layer."""
        self._float_weight.drop()
        self._cpu_codes.drop()

    def pack_cpu_weight(self) -> bool:
        """Prepare the serving engine's CPU forward now (``pack_linears``), a one-time cost at load:
        the codes' layout where ``fp8_linear_codes`` runs (no float copy at all), else
        ``float_weight()`` packed too (``dense_cpu.pack_weight``), for batches of ``packed_from_rows()``
        rows or more (4 bytes per weight more). False where the CPU forward would use neither: weight-only
        layers, the float copy turned off, no packed kernel, not on the CPU. Asks ``fp8_kernel`` what a
        float32 token runs, as the engine's forward will."""
        if not self.weight.is_cpu:
            return False
        with torch.no_grad():
            kernel = fp8_kernel(self, torch.empty(1, self.in_features))
            if kernel is FP8_CODES:
                self.cpu_codes()
                return True
            copies = kernel.name in (FP8_FLOAT_COPY_CALL.name, FP8_FLOAT_COPY.name)
            if not (copies and self.format.quantizes_activations and packing_available()):
                return False
            self._packed_weight = DerivedTensor()
            self._packed()
        return True

    def _packed(self) -> torch.Tensor:
        return self._packed_weight.get((self.weight, self.weight_scale), lambda: pack_weight(self.float_weight()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._RUNS[fp8_kernel(self, x).name](self, x)

    def _on_codes(self, x: torch.Tensor) -> torch.Tensor:  # 1 byte per weight read, where the copy reads 4
        return cpu_kernels().fp8_linear_codes(x, self.input_shift, self.input_scale, self.format.activation_torch_dtype,
                                              self.cpu_codes(), self.weight.dtype, self.weight_scale, self.out_features,
                                              self.bias)

    def _on_float_copy_in_one_call(self, x: torch.Tensor) -> torch.Tensor:
        # at a few tokens the Python path costs more than its arithmetic
        takes_packed = self._packed_weight is not None and x.numel() >= packed_from_rows() * self.in_features
        return cpu_kernels().fp8_linear(x, self.input_shift, self.input_scale, self.format.activation_torch_dtype,
                                        self.float_weight(), self.bias, self._packed() if takes_packed else None)

    def _on_float_copy(self, x: torch.Tensor) -> torch.Tensor:
        return self._per_call(x, self.float_weight())

    def _without_copy(self, x: torch.Tensor) -> torch.Tensor:
        return self._per_call(x, None)

    def _per_call(self, x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        """The Python path: on ``w`` (the float32 copy), else per call (``fp8_gemm`` or the dequantized weight)."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if not self.format.quantizes_activations:
            w = self.dequantized_weight() if w is None else w
            y = self._centred(x2).to(x.dtype) @ w.to(x.dtype).t()
            y = y + self.bias if self.bias is not None else y
        else:
            if w is None:
                xq, xs = self.quantize_input(x2)
                y = fp8_gemm(xq, xs, self.weight, self.weight_scale, self.bias, x.dtype)
            else:  # the dequantize reference's arithmetic on the copy: the same output
                packed = None if self._packed_weight is None else self._packed
                y = float_gemm(self.cpu_activations(x2), w, self.bias, x.dtype, packed)
            if self.outlier_index is not None:
                y = y + self._outlier_part(x2)
        return y.reshape(*shape[:-1], self.out_features)

    _RUNS = {FP8_CODES.name: _on_codes, FP8_FLOAT_COPY_CALL.name: _on_float_copy_in_one_call,
             FP8_FLOAT_COPY.name: _on_float_copy, FP8_GEMM.name: _without_copy, FP8_WEIGHT_ONLY.name: _without_copy}
