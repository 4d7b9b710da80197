"""The decoder: its config (``config.py``), the model (``transformer.py``) and the KV-cache
interface its attention talks to (``kv_cache.py``)."""
