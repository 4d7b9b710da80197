"""Deployment backends; each registers its target's constraints on import."""
import backends.ascend  # noqa: F401
import backends.onnx  # noqa: F401
