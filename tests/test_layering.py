"""The import rules between the top-level packages (docs/ARCHITECTURE.md)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("calib", "compiler", "passes", "backends", "serving")


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(PACKAGES)


def files(package: str):
    return sorted((ROOT / package).rglob("*.py"))


def allowed(path: Path) -> set[str]:
    rel = path.relative_to(ROOT).parts
    package = rel[0]
    if package == "calib":
        return {"calib"}
    if package == "compiler":
        return set(PACKAGES) if rel[1] == "cli" else {"calib", "compiler"}
    if package == "passes":
        return {"calib", "compiler", "passes"}
    if package == "serving":
        return {"calib", "compiler", "serving", "backends"}
    if package == "backends":
        # Only the Triton deployment runs the engine in-process.
        extra = {"serving"} if rel[1] == "triton" else set()
        return {"calib", "compiler", "backends"} | extra
    raise AssertionError(package)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_layers(package):
    problems = []
    for path in files(package):
        bad = imported_packages(path) - allowed(path)
        if bad:
            problems.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not problems, "\n".join(problems)


def test_the_check_can_fail(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import passes.awq\nfrom serving import Engine\n")
    assert imported_packages(f) == {"passes", "serving"}
