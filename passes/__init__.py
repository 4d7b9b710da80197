from passes import paged_kv  # noqa: F401
