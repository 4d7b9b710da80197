"""Progress bars (rich) for long passes, off when output is not a terminal or when asked."""
from __future__ import annotations

import os
import sys
from typing import Iterable, Iterator, TypeVar

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

T = TypeVar("T")


def progress_enabled() -> bool:
    return os.environ.get("QCOMPILE_PROGRESS", "auto") != "0" and (sys.stderr.isatty() or os.environ.get("QCOMPILE_PROGRESS") == "1")


def make_progress() -> Progress:
    from rich.console import Console

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True), disable=not progress_enabled(),
    )


def track(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Iterate ``items`` with a progress bar on stderr."""
    with make_progress() as progress:
        yield from progress.track(items, total=total, description=description)
