"""Errors of the distillation pass (one line each at the CLI, like every ``QCompileError``)."""
from compiler.errors import ConfigError, PassError


class DistillConfigError(ConfigError):
    """A distillation option or model pair that cannot work together."""


class TrainingDivergedError(PassError):
    """Too many consecutive steps with a non-finite loss or gradient; the last good checkpoint is kept."""
