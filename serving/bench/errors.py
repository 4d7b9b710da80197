"""Errors of the benchmark suite: one line, saying what is wrong and what to do."""
from __future__ import annotations

from compiler.errors import QCompileError


class BenchError(QCompileError):
    """A benchmark setting, target, workload or result file that is not usable."""


class RegressionError(QCompileError):
    """``bench compare --fail-on-regression`` found a metric worse than the noise band allows."""

    exit_code = 3
