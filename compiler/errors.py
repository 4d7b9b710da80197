"""Typed errors: every error qcompile raises for a user to fix derives from ``QCompileError``, which
the CLI prints as one line and exits with its ``exit_code``. This module imports nothing, so it sits
below every layer (``calib/`` included) and each can raise these."""
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


class LoweringIncomplete(QCompileError):
    """A lowering wrote its output but could not finish here (e.g. no ATC to build the .om);
    ``lowered`` (a ``compiler.deploy.targets.LowerResult``) is what it wrote, for the caller to show."""

    def __init__(self, message: str, lowered=None):
        super().__init__(message)
        self.lowered = lowered
