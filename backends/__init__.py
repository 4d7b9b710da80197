"""Deployment backends; each registers its target's constraints and its lowering on import."""
import backends.ascend  # noqa: F401
import backends.gguf  # noqa: F401
import backends.onnx  # noqa: F401
import backends.triton  # noqa: F401
import backends.vllm  # noqa: F401
