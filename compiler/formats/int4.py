"""INT4 weight-only format (W4A16): packing and ``Int4Linear``.

Layout — chosen to be ONNX Runtime's com.microsoft ``MatMulNBits`` (bits=4, block_size=g)
byte for byte, so that lowering is a reshape, never a re-quantization:

    K = in_features, N = out_features, g = group_size, n_blocks = ceil(K / g)
    qweight  uint8 [N, n_blocks, g // 2]  two 4-bit codes per byte, element k of row n lives in
                                          block k // g, byte (k % g) // 2; even k in the low
                                          nibble, odd k in the high nibble. K is zero-padded up
                                          to n_blocks * g (padded codes equal the zero point).
    scales   dtype [N, n_blocks]          model dtype (float32 / float16 / bfloat16)
    qzeros   uint8 [N, ceil(n_blocks / 2)] 4-bit zero points, low nibble first; symmetric
                                          quantization stores 8 (MatMulNBits' default).
    bias     dtype [N]                    optional

    w[n, k] = (q[n, k] - z[n, k // g]) * s[n, k // g]

The primitives (choose qparams, quantize, dequantize) are in ``compiler/quant/int4.py``.

``forward`` runs what ``compiler/kernels/dispatch.py``'s ``int4_kernel`` chooses, by device: on CUDA
the Triton W4A16 kernel (``compiler/kernels/w4a16.py``); on the CPU torch's INT4 kernel (``compiler/kernels/int4_cpu.py``) on a copy of the weights repacked
at first use (codes unchanged; the copy is an attribute, not a buffer, so it never enters the
artifact, and it is rebuilt when the buffers change, move or change dtype), and for a prefill's
many float32 tokens qcompile's ``int4_dense_linear`` on the buffers themselves. A layer torch's
kernel cannot take says why in ``kernel_reason`` and runs ``reference_forward`` (unpack,
dequantize, matmul), which is also what every kernel is tested against — or, on float32 outside
autograd, ``int4_dense_linear``, the reference's arithmetic a panel at a time (~1e-7 apart).
``use_w4a8()`` (the serving plan's ``int4_compute = "w4a8"``) puts a layer's CPU forwards on
int8 activations instead, every row count (``compiler/kernels/w4a8_cpu.py``: a numerics change,
asked for, never chosen silently).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from compiler.formats.qlinear import QuantizedLinear, register_format
from compiler.kernels import w4a8_cpu
from compiler.kernels.dense_cpu import DerivedTensor
from compiler.kernels.dispatch import (
    INT4_CUDA_MANY_TOKENS,
    INT4_PREFILL,
    INT4_TORCH,
    INT4_TRITON,
    REFERENCE,
    W4A8,
    int4_kernel,
)
from compiler.kernels.int4_cpu import (
    KERNEL,
    Int4CpuPack,
    int4_cpu_matmul,
    int4_dense_matmul,
    layer_unsupported_reason,
    pack_for_cpu,
)
from compiler.quant.int4 import (
    SYMMETRIC_ZERO,
    choose_qparams,
    dequantize,
    pad_columns,
    quantize,
)

def pack_int4(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """Codes [N, K] -> qweight uint8 [N, K // g, g // 2] (MatMulNBits B layout)."""
    N, K = q.shape
    pairs = q.view(N, K // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.view(N, K // group_size, group_size // 2)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """qweight [N, n_blocks, g // 2] -> codes uint8 [N, n_blocks * g]."""
    N = qweight.shape[0]
    low, high = qweight & 0x0F, qweight >> 4
    return torch.stack((low, high), dim=-1).view(N, -1)


def pack_zeros(zero: torch.Tensor) -> torch.Tensor:
    """Zero points [N, n_blocks] -> uint8 [N, ceil(n_blocks / 2)], low nibble first."""
    if zero.shape[1] % 2:
        zero = F.pad(zero, (0, 1), value=SYMMETRIC_ZERO)
    pairs = zero.view(zero.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_zeros(qzeros: torch.Tensor, n_blocks: int) -> torch.Tensor:
    low, high = qzeros & 0x0F, qzeros >> 4
    return torch.stack((low, high), dim=-1).view(qzeros.shape[0], -1)[:, :n_blocks]


def _version(t: torch.Tensor) -> int:
    """The version counter of a buffer (-1 for an inference tensor, which has none and is never written)."""
    return -1 if t.is_inference() else t._version


@register_format
class Int4Linear(QuantizedLinear):
    """W4A16 linear layer in the layout above; ``forward`` matches ``nn.Linear``'s.

    ``kernel`` names what a CPU forward runs (``KERNEL``, ``w4a8_cpu.KERNEL``, or ``"reference"``) and ``kernel_reason``
    why a layer cannot use the kernel (None when it can); ``fallbacks`` collects the reasons of
    calls that ran the reference anyway (e.g. float64 activations).
    """

    format_name = "int4"

    def __init__(self, in_features: int, out_features: int, group_size: int, zero_point: bool,
                 qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_size, self.zero_point = group_size, zero_point
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("bias", bias)
        self.kernel, self.kernel_reason = self._w4a16_kernel()
        self.fallbacks: set[str] = set()
        self._cpu_pack: Int4CpuPack | None = None  # derived, never saved: see cpu_pack()
        self._cpu_pack_source: tuple | None = None  # the buffers it was built from, and their versions
        self._float_zeros = DerivedTensor()  # never saved: see float_zeros()
        self._w4a8 = False  # CPU forwards on int8 activations: see use_w4a8()
        self._w4a8_pack = DerivedTensor()  # never saved: see w4a8_pack()

    @property
    def n_blocks(self) -> int:
        return self.qweight.shape[1]

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, in_features: int,
                   group_size: int, zero_point: bool, bias: torch.Tensor | None) -> "Int4Linear":
        """Pack codes [N, K_padded] with their per-group scale and zero point."""
        return cls(in_features, q.shape[0], group_size, zero_point, pack_int4(q, group_size), scale,
                   pack_zeros(zero), None if bias is None else bias.detach().clone())

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int, zero_point: bool = True,
                   clip_ratio: torch.Tensor | float = 1.0) -> "Int4Linear":
        """Round-to-nearest quantization of ``linear`` (K zero-padded to a multiple of the group)."""
        w = pad_columns(linear.weight.detach(), group_size)
        scale, zero = choose_qparams(w, group_size, zero_point, clip_ratio)
        q = quantize(w, scale, zero, group_size)
        return cls.from_codes(q, scale, zero, linear.in_features, group_size, zero_point, linear.bias)

    def format_meta(self) -> dict:
        return {"format": self.format_name, "group_size": self.group_size, "zero_point": self.zero_point,
                "in_features": self.in_features, "out_features": self.out_features,
                "padded_in_features": self.n_blocks * self.group_size}

    @classmethod
    def empty(cls, meta, in_features, out_features, bias, dtype):
        g = meta["group_size"]
        n_blocks = math.ceil(in_features / g)
        return cls(in_features, out_features, g, meta["zero_point"],
                   torch.empty(out_features, n_blocks, g // 2, dtype=torch.uint8),
                   torch.empty(out_features, n_blocks, dtype=dtype),
                   torch.empty(out_features, math.ceil(n_blocks / 2), dtype=torch.uint8),
                   torch.empty(out_features, dtype=dtype) if bias else None)

    def codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Unpacked codes [N, K_padded] and zero points [N, n_blocks]."""
        return unpack_int4(self.qweight), unpack_zeros(self.qzeros, self.n_blocks)

    def dequantized_weight(self) -> torch.Tensor:
        q, zero = self.codes()
        return dequantize(q, self.scales, zero, self.group_size)[:, : self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = int4_kernel(self, x)
        if kernel.recorded:
            self.fallbacks.add(kernel.why)
        return self._RUNS[kernel.name](self, x)

    def _triton(self, x: torch.Tensor) -> torch.Tensor:
        from compiler.kernels.w4a16 import w4a16_matmul

        bias = None if self.bias is None else self.bias.to(x.dtype)
        return w4a16_matmul(x, self.qweight, self.scales, self.qzeros, self.in_features, self.group_size, bias)

    def _dequantize_then_linear(self, x: torch.Tensor) -> torch.Tensor:
        from compiler.kernels.w4a16 import w4_dequantize

        bias = None if self.bias is None else self.bias.to(x.dtype)
        w = w4_dequantize(self.qweight, self.scales, self.qzeros, self.in_features, self.group_size, x.dtype)
        return F.linear(x, w, bias)

    def _w4a8_forward(self, x: torch.Tensor) -> torch.Tensor:
        return w4a8_cpu.w4a8_matmul(x, self.w4a8_pack(), self._buffers["bias"])

    def _torch_int4(self, x: torch.Tensor) -> torch.Tensor:
        return int4_cpu_matmul(x, self.cpu_pack(), self._buffers["bias"])

    def _prefill(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return int4_dense_matmul(x, buffers["qweight"], buffers["scales"], self.float_zeros(), self.group_size,
                                 buffers["bias"])

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Unpack -> dequantize -> matmul in x's dtype: the reference every kernel is tested against."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight().to(x.dtype), bias)

    _RUNS = {INT4_TRITON.name: _triton, INT4_CUDA_MANY_TOKENS.name: _dequantize_then_linear, W4A8.name: _w4a8_forward,
             INT4_TORCH.name: _torch_int4, INT4_PREFILL.name: _prefill, REFERENCE.name: reference_forward}

    @property
    def runs_w4a8(self) -> bool:
        """Whether CPU forwards run on int8 activations (``use_w4a8``)."""
        return self._w4a8

    def use_w4a8(self, enabled: bool = True) -> str | None:
        """Run this layer's CPU forwards on int8 activations (W4A8, ``compiler/kernels/w4a8_cpu.py``:
        a numerics change the serving plan asks for, ``int4_compute = "w4a8"``), or back on the
        format's W4A16. Returns why the layer cannot (it then stays W4A16), else None."""
        why = (w4a8_cpu.w4a8_unavailable_reason() or w4a8_cpu.layer_unsupported_reason(self.group_size)) if enabled else None
        self._w4a8 = enabled and why is None
        self.kernel, self.kernel_reason = (w4a8_cpu.KERNEL, None) if self._w4a8 else self._w4a16_kernel()
        return why

    def _w4a16_kernel(self) -> tuple[str, str | None]:
        """(what a W4A16 CPU forward runs, why not torch's kernel or None)."""
        why = layer_unsupported_reason(self.out_features, self.n_blocks * self.group_size, self.group_size)
        return ("reference" if why else KERNEL), why

    def w4a8_pack(self) -> w4a8_cpu.W4A8Pack:
        """The weights in ``w4a8_linear``'s layout, kept (never saved) until a buffer changes."""
        buffers = self._buffers
        qweight, scales, qzeros = buffers["qweight"], buffers["scales"], buffers["qzeros"]

        def build():
            q, zero = self.codes()
            return w4a8_cpu.pack_w4a8(q, scales, zero, self.group_size)

        return self._w4a8_pack.get((qweight, scales, qzeros), build)

    def float_zeros(self) -> torch.Tensor:
        """The zero points unpacked, float32 [N, n_blocks], for ``int4_dense_linear``: kept (never
        saved) until ``qzeros`` is replaced or written in place, not unpacked on every call."""
        qzeros = self._buffers["qzeros"]
        return self._float_zeros.get((qzeros,), lambda: unpack_zeros(qzeros, self.n_blocks).float())

    def cpu_pack(self) -> Int4CpuPack:
        """The weights in the CPU kernel's layout, built on first use and again whenever a buffer is
        replaced (``to``, ``load_state_dict(assign=True)``) or written in place (its version counter)."""
        buffers = self._buffers  # not self.qweight: nn.Module.__getattr__ costs µs on every call
        qweight, scales, qzeros = buffers["qweight"], buffers["scales"], buffers["qzeros"]
        source = self._cpu_pack_source  # this runs on every call: plain comparisons, no generators
        if (source is None or source[0] is not qweight or source[1] is not scales or source[2] is not qzeros
                or source[3] != _version(qweight) or source[4] != _version(scales) or source[5] != _version(qzeros)):
            q, zero = self.codes()
            self._cpu_pack = pack_for_cpu(q, scales, zero, self.group_size)
            self._cpu_pack_source = (qweight, scales, qzeros, _version(qweight), _version(scales), _version(qzeros))
        return self._cpu_pack

    def extra_repr(self) -> str:
        why = f" ({self.kernel_reason})" if self.kernel_reason else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"zero_point={self.zero_point}, kernel={self.kernel}{why}")
