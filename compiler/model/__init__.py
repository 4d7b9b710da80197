"""The decoder: its config (``config.py``, read from HF configs by ``hf_config.py``), what each
architecture's layers are made of (``architectures.py``), the building blocks (``layers.py``,
``moe.py``), their assembly (``transformer.py``) and the KV-cache interface its attention talks
to (``kv_cache.py``)."""
