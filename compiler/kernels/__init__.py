"""Hand-written GPU kernels (OpenAI Triton) behind the quantized formats' forward."""
