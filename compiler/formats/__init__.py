"""Quantized weight formats: the ``QuantizedLinear`` base and registry (``qlinear.py``), INT4 W4A16
(``int4.py``), FP8 (``fp8.py``) and the FP8 KV cache (``fp8_kv.py``). Each format documents its
buffers where it is defined; the numerics they share are in ``compiler.quant``, the GPU kernels
behind their ``forward`` in ``compiler.kernels``."""
