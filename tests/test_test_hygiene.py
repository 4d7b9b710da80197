"""Rules for the tests themselves, checked on their source: no subprocess without a timeout (a hung
child would hang the suite), no seed from ``hash()`` (it changes per process, so a failure could not
be reproduced), a maximum over values that may be NaN that does not drop the NaN, and one relative
error for every check (``numerics.relative_error``, where NaN never passes)."""
from __future__ import annotations

import ast
import math
from pathlib import Path

import torch
from distill_helpers import max_difference
from numerics import relative_error

TESTS = Path(__file__).resolve().parent
SUBPROCESS_CALLS = {"run", "call", "check_call", "check_output"}


def source_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            yield node


def where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(TESTS.parent)}:{node.lineno}"


def test_every_subprocess_has_a_timeout():
    missing = []
    for path in source_files():
        for node in calls(path):
            f = node.func
            is_subprocess = (isinstance(f, ast.Attribute) and f.attr in SUBPROCESS_CALLS
                             and isinstance(f.value, ast.Name) and f.value.id == "subprocess")
            is_communicate = isinstance(f, ast.Attribute) and f.attr == "communicate"
            if (is_subprocess or is_communicate) and not any(k.arg == "timeout" for k in node.keywords):
                missing.append(where(path, node))
    assert not missing, f"subprocess calls without a timeout: {', '.join(missing)}"


def test_no_seed_from_hash():
    uses = [where(path, node) for path in source_files() for node in calls(path)
            if isinstance(node.func, ast.Name) and node.func.id == "hash"]
    assert not uses, f"hash() changes per process (PYTHONHASHSEED); use a fixed or crc32-based seed: {', '.join(uses)}"


def test_max_difference_keeps_a_nan():
    a = {"x": torch.zeros(3), "y": torch.zeros(2), "z": torch.zeros(1)}
    b = {"x": torch.zeros(3), "y": torch.tensor([0.0, float("nan")]), "z": torch.ones(1)}
    assert math.isnan(max_difference(a, b))
    assert not math.isnan(max(float((a[k] - b[k]).abs().max()) for k in a))  # what Python's max() made of it
    assert max_difference(a, {**b, "y": torch.zeros(2)}) == 1.0


def test_one_relative_error_for_the_tests():
    copies = [where(path, node) for path in source_files() if path.name != "numerics.py"
              for node in ast.walk(ast.parse(path.read_text(), str(path)))
              if isinstance(node, ast.FunctionDef) and node.name in {"rel_err", "rel_error", "relative_error"}
              and path.name != "onnx_helpers.py"]  # its rel_error is the max-abs error of numpy outputs
    assert not copies, f"use numerics.relative_error instead of a copy: {', '.join(copies)}"


def test_relative_error_never_passes_a_nan():
    ref = torch.ones(4)
    assert relative_error(torch.tensor([1.0, float("nan"), 1.0, 1.0]), ref) == math.inf
    assert relative_error(ref, torch.tensor([1.0, float("inf"), 1.0, 1.0])) == math.inf
    assert relative_error(ref * 1.5, ref) == 0.5
