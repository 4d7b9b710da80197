"""Count the calls made to a function from now on, still calling it (a spy, not a double)."""
from __future__ import annotations

import sys


def record_calls(monkeypatch, owner, name: str) -> list:
    """Wrap ``owner.name`` (a module or class attribute) for the rest of the test; returns the list of calls' arguments."""
    calls, original = [], getattr(owner, name)

    def recorded(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, recorded)
    return calls


def record_calls_everywhere(monkeypatch, function) -> list:
    """``record_calls`` on ``function`` in every loaded module that holds it under its name: a
    ``from module import function`` copies the name, so patching the defining module alone misses those calls."""
    holders = [m for m in list(sys.modules.values()) if vars(m).get(function.__name__) is function]
    calls: list = []

    def recorded(*args, **kwargs):
        calls.append(args)
        return function(*args, **kwargs)

    for module in holders:
        monkeypatch.setattr(module, function.__name__, recorded)
    return calls
