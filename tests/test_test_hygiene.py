"""Rules for the tests themselves, checked on their source: no subprocess without a timeout (a hung
child would hang the suite), no seed from ``hash()`` (it changes per process, so a failure could not
be reproduced), a maximum over values that may be NaN that does not drop the NaN, one relative
error for every check (``numerics.relative_error``, where NaN never passes), and ``pytest -m gpu``
selecting every OpenAI-Triton kernel test (the ``kernel_device`` fixture) without skipping them on
a CPU-only host."""
from __future__ import annotations

import ast
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
from distill_helpers import max_difference
from numerics import relative_error

TESTS = Path(__file__).resolve().parent
# A kernel test quick in Triton's interpreter, to see that -m gpu runs (not skips) them on a CPU-only host.
QUICK_KERNEL_TEST = "tests/compiler/kernels/test_fp8_kernels.py::test_triton_activation_cast_matches_torch[False-3-50-dtype0]"
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


def kernel_device_tests() -> dict[str, set[str]]:
    """The test functions that take the ``kernel_device`` fixture, directly or through fixtures
    that take it (``fp8_device``), by file relative to the checkout."""
    functions = [(path, node) for path in source_files() for node in ast.walk(ast.parse(path.read_text(), str(path)))
                 if isinstance(node, ast.FunctionDef)]
    users = {"kernel_device"}
    while True:  # fixtures that use a user are users: until none is added
        more = {node.name for _, node in functions if not node.name.startswith("test") and node.decorator_list
                and any(a.arg in users for a in node.args.args)} - users
        if not more:
            break
        users |= more
    found: dict[str, set[str]] = {}
    for path, node in functions:
        if node.name.startswith("test") and any(a.arg in users for a in node.args.args):
            found.setdefault(path.relative_to(TESTS.parent).as_posix(), set()).add(node.name)
    return found


def pytest_in_the_checkout(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent), "QCOMPILE_PROGRESS": "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], capture_output=True,
                          text=True, cwd=TESTS.parent, env=env, timeout=600)


def test_gpu_marker_selects_every_kernel_test():
    """``pytest -m gpu`` is the one step a GPU host runs: the Triton kernel tests must be in it."""
    expected = kernel_device_tests()
    assert len(expected) >= 3 and "tests/compiler/kernels/test_w4a16_kernel.py" in expected, expected  # the scan sees them
    run = pytest_in_the_checkout("--collect-only", "-q", "-m", "gpu", *sorted(expected))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    selected = {(i.split("::")[0], i.split("::")[-1].split("[")[0]) for i in run.stdout.splitlines() if "::" in i}
    missing = sorted(f"{f}::{name}" for f, names in expected.items() for name in names if (f, name) not in selected)
    assert not missing, f"kernel tests that pytest -m gpu leaves out: {', '.join(missing)}"


def test_gpu_marker_does_not_skip_kernel_tests_without_a_gpu():
    """Marked by the fixture, a kernel test still runs where there is no GPU (in Triton's interpreter)."""
    run = pytest_in_the_checkout("-q", "-m", "gpu", "-rs", QUICK_KERNEL_TEST)
    assert run.returncode == 0 and "1 passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
