"""The import rules of docs/ARCHITECTURE.md: one ordered list of layers, no exceptions.

A module may import modules of its own layer or of layers below it, never above; and no two
files import each other, directly or through others (imports inside functions count too: a
lazy import is still a dependency).
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top. A module belongs to the layer of the longest prefix that names it.
LAYERS = (
    ("compiler.errors",),  # imports nothing: every layer raises its errors, calib/ included
    ("calib",),
    ("compiler", "compiler.options", "compiler.progress"),
    ("compiler.quant",),
    ("compiler.kernels",),
    ("compiler.formats",),
    ("compiler.model",),
    ("compiler.io",),
    ("compiler.deploy",),
    ("compiler.pipeline",),
    ("passes",),
    ("backends",),
    ("serving",),
    ("qcompile",),
)
PACKAGES = sorted({prefixes[0].split(".")[0] for prefixes in LAYERS})


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Our modules that ``path`` imports (``from X import Y`` counts X.Y when Y is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `import a.b.c` where c is an attribute
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def layer_of(module: str) -> int:
    best, level = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    if level is None:
        raise AssertionError(f"{module} is in no layer; add its package to LAYERS")
    return level


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {m: imports_of(p, set(modules)) - {m} for m, p in modules.items()}


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    return [f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
            for m, deps in sorted(g.items()) for d in sorted(deps) if layer_of(d) > layer_of(m)]


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    for module in all_modules():
        layer_of(module)


def test_no_import_runs_up_the_layers():
    problems = upward_imports(graph())
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "\n".join(" ⇄ ".join(c) for c in found)


@pytest.mark.parametrize("source, expected", [
    ("import passes.awq\nfrom serving import engine\n", {"passes.awq", "serving.engine"}),
    ("def f():\n    from compiler.io.artifact import load_artifact\n", {"compiler.io.artifact"}),
])
def test_the_scan_sees_imports(tmp_path, source, expected):
    f = tmp_path / "x.py"
    f.write_text(source)
    assert imports_of(f, set(all_modules())) == expected


def test_the_checks_can_fail():
    g = {"compiler.formats.int4": {"compiler.io.artifact"}, "compiler.io.artifact": {"compiler.formats.int4"},
         "backends.triton.lower": {"serving.engine"}, "serving.engine": set()}
    assert cycles(g) == [["compiler.formats.int4", "compiler.io.artifact"]]
    assert upward_imports(g) == ["backends.triton.lower (layer 11) imports serving.engine (layer 12)",
                                 "compiler.formats.int4 (layer 5) imports compiler.io.artifact (layer 7)"]
