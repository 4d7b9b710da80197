"""Typed errors. The CLI prints any ``QCompileError`` as one line and exits non-zero."""
from __future__ import annotations


class QCompileError(Exception):
    """Base of every error a user can cause and fix; the message says what to do."""

    exit_code = 2


class ConfigError(QCompileError):
    """A pipeline file, option or command-line value that is not valid."""


class CheckpointError(QCompileError):
    """A checkpoint that cannot be read: missing, corrupt, pickled, or of an unsupported architecture."""


class ArtifactError(QCompileError):
    """A compiled artifact that is missing, of another schema version, corrupt or truncated."""


class PassError(QCompileError):
    """A pass that failed while running; the message names the pass and what ran before it."""


class PipelineValidationError(ConfigError):
    """A pipeline that cannot run as declared: found before any pass runs."""
