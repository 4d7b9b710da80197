"""Serving adapters: one ``ServingAdapter`` per runtime (ONNX Runtime, Ascend .om, …)."""
