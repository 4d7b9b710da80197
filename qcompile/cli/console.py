"""The command line's two consoles: ``out`` (results, stdout) and ``err`` (errors and progress, stderr).

In a terminal they take its width. When output goes to a file or a pipe (a log, CI) rich would
assume 80 columns and cut or fold table cells (``con…``, ``out/examp…``); there they are wide
enough that every table row stays whole on one line.
"""
from __future__ import annotations

import sys

from rich.console import Console

# Wider than any table qcompile prints; rich never pads a table to the console's width.
LOG_WIDTH = 1000


def make_console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else LOG_WIDTH)


out = make_console()
err = make_console(stderr=True)
