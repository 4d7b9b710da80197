"""Every built-in pass; importing this package registers them with ``compiler.pipeline``."""
from passes import fp8  # noqa: F401
