"""Serving adapters: one ``ServingAdapter`` per way of reaching a model (see ``serving.types``)."""
