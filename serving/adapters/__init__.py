"""Serving adapters: one ``serving.types.ServingAdapter`` per deployment target (in-process engine,
Triton gRPC/HTTP, ONNX Runtime, Ascend .om)."""
