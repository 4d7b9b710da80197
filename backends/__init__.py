"""Deployment backends; each registers its target constraints and lowering on import."""
import backends.triton  # noqa: F401
