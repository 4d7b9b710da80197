"""Quantization primitives on plain tensors — choose qparams, quantize, dequantize — for INT4
(``int4.py``) and FP8 (``fp8.py``), apart from any packed layout or module (as torchao keeps them)."""
