"""Built-in passes; each registers itself with ``compiler.pipeline.register_pass`` on import."""
import passes.awq  # noqa: F401
import passes.distill  # noqa: F401
import passes.fp8  # noqa: F401
import passes.int8  # noqa: F401
import passes.paged_kv  # noqa: F401
import passes.rotate  # noqa: F401
