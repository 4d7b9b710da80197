"""Triton Inference Server target: lowering (``lower.py``), the served model (``model.py``), the server (``runtime.py``)."""
