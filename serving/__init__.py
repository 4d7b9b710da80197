"""The serving runtime: paged KV cache, continuous-batching engine, adapters.

``from serving import Engine`` is lazy so that importing ``serving.types`` (adapters, clients)
does not pull in torch models.
"""
from __future__ import annotations


def __getattr__(name):
    if name == "Engine":
        from serving.engine import Engine

        return Engine
    raise AttributeError(f"module 'serving' has no attribute {name!r}")
