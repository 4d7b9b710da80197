"""Serving adapters: one ``serving.types.ServingAdapter`` per deployment target."""
