"""Count the calls made to a function from now on, still calling it (a spy, not a double)."""
from __future__ import annotations


def record_calls(monkeypatch, owner, name: str) -> list:
    """Wrap ``owner.name`` (a module attribute) for the rest of the test; returns the list of calls' arguments."""
    calls, original = [], getattr(owner, name)

    def recorded(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(owner, name, recorded)
    return calls
