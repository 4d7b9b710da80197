"""Quantized weight formats: the ``QuantizedLinear`` base and registry (``qlinear.py``), INT4 W4A16
(``int4.py``), INT8 W8A8 / W8A16 (``int8.py``), FP8 (``fp8.py``) and the FP8 / INT8 KV caches
(``kv_quant.py``). Each format documents its buffers where it is defined; the numerics they share
are in ``compiler.quant``, the GPU kernels behind their ``forward`` in ``compiler.kernels``."""
