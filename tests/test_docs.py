"""The docs as references: BENCHMARKS.md agrees with docs/data/, and every link, code path and
module the docs name exists.

Each section of docs/BENCHMARKS.md ends with bullets (**Measured:**, **Hardware:**, **Commit:**,
**Data:**, optionally **Studies:**) and holds its commands in fenced blocks; its tables, commands
and bullets are also written to the JSON file its **Data:** bullet names first. After editing a
section, rewrite those files with ``python tests/test_docs.py``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BENCHMARKS = DOCS / "BENCHMARKS.md"
DOC_FILES = sorted([ROOT / "README.md", *DOCS.glob("*.md"), *(DOCS / "notes").glob("*.md")])
FIELDS = ("Measured", "Hardware", "Commit", "Data")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
PACKAGES = ("calib", "compiler", "passes", "backends", "serving", "qcompile")
TOP_DIRS = (*PACKAGES, "benchmarks", "scripts", "docs", "examples", "tests", ".ci")
NOT_MODULES = {"qcompile.bench",  # the name of the bench result schema
               "qcompile.notes", "qcompile.artifact_manifest_sha256"}  # keys a GGUF file written by qcompile carries


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [m.group(1) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)]


def sections(path: Path = BENCHMARKS) -> dict[str, list[str]]:
    """``## `` heading -> the section's lines."""
    found: dict[str, list[str]] = {}
    current = None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            current = found.setdefault(line[3:], [])
        elif current is not None:
            current.append(line)
    return found


def repo_path(target: str, base: Path = DOCS) -> str:
    return str((base / target).resolve().relative_to(ROOT))


def cell(text: str):
    """A table cell as JSON: markup dropped, links as their repository path, plain numbers as numbers."""
    text = LINK.sub(lambda m: repo_path(m.group(2)), text.replace("**", "").replace("`", "")).strip()
    number = text.replace(" ", "") if re.fullmatch(r"\d{1,3}( \d{3})+(\.\d+)?", text) else text
    if re.fullmatch(r"-?\d+", number):
        return int(number)
    if re.fullmatch(r"-?\d+\.\d+", number):
        return float(number)
    return text or None


def plain(text: str) -> str:
    """Markdown to plain text: links as their text, no code or bold marks."""
    return LINK.sub(r"\1", text).replace("`", "").replace("**", "")


def split_row(line: str) -> list[str]:
    return line.strip().strip("|").split("|")


def tables(lines: list[str]) -> list[dict]:
    """Every markdown table of a section with its caption (the paragraph before it, ending in ':')."""
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.fullmatch(r"[|\-: ]+", lines[i + 1]):
            para = []
            j = i - 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            while j >= 0 and lines[j].strip():
                para.insert(0, lines[j].strip())
                j -= 1
            caption = plain(" ".join(para))
            columns = [cell(c) for c in split_row(lines[i])]
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([cell(c) for c in split_row(lines[i])])
                i += 1
            found.append({"caption": caption if caption.endswith(":") else None, "columns": columns, "rows": rows})
        else:
            i += 1
    return found


def commands(lines: list[str]) -> list[str]:
    """The lines of the section's fenced blocks, continuation lines joined."""
    found, inside, pending = [], False, ""
    for line in lines:
        if line.startswith("```"):
            inside = not inside
            continue
        if inside and line.strip():
            pending += line.strip()
            if pending.endswith("\\"):
                pending = pending[:-1].rstrip() + " "
            else:
                found.append(pending)
                pending = ""
    return found


def bullets(lines: list[str]) -> dict[str, str]:
    found = {}
    for line in lines:
        m = re.match(r"- \*\*(\w+):\*\* (.*)$", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def section_data(title: str, lines: list[str]) -> dict:
    """What a section's JSON file holds."""
    fields = bullets(lines)
    return {
        "section": title,
        "source": f"docs/BENCHMARKS.md#{slug(title)}",
        "measured": plain(fields["Measured"]),
        "hardware": plain(fields["Hardware"]),
        "commit": plain(fields["Commit"]),
        "commits": re.findall(r"\b[0-9a-f]{7,40}\b", fields["Commit"]),
        "commands": commands(lines),
        "tables": tables(lines),
        "data_files": [repo_path(m.group(2)) for m in LINK.finditer(fields["Data"])],
        "studies": [repo_path(m.group(2)) for m in LINK.finditer(fields.get("Studies", ""))],
    }


def measured_sections() -> dict[str, list[str]]:
    return {t: s for t, s in sections().items() if t != "Which recipe for which target"}


def dumps(data: dict) -> str:
    """JSON with one line per table row, so that a diff shows which figures changed."""
    def line(value) -> str:
        return json.dumps(value, ensure_ascii=False)

    tables = ",\n".join(
        f'  {{"caption": {line(t["caption"])},\n   "columns": {line(t["columns"])},\n   "rows": [\n'
        + ",\n".join(f"    {line(row)}" for row in t["rows"]) + "]}"
        for t in data["tables"])
    text = json.dumps({**data, "tables": "TABLES"}, indent=1, ensure_ascii=False)
    return text.replace('"TABLES"', f"[\n{tables}\n ]") + "\n"


def write_data_files() -> None:
    for title, lines in measured_sections().items():
        data = section_data(title, lines)
        (ROOT / data["data_files"][0]).write_text(dumps(data))


@pytest.mark.parametrize("title", list(measured_sections()))
def test_section_is_a_reference_with_its_json(title):
    lines = measured_sections()[title]
    missing = [f for f in FIELDS if f not in bullets(lines)]
    assert not missing, f"section {title!r} lacks the bullets {missing}"
    data = section_data(title, lines)
    assert data["commands"] and data["tables"], f"section {title!r} needs a command block and a table"
    assert all(t["caption"] for t in data["tables"]), f"a table of {title!r} has no caption ending in ':'"
    stored = ROOT / data["data_files"][0]
    assert stored.is_file(), f"{stored} is missing: run python tests/test_docs.py"
    assert json.loads(stored.read_text()) == data, f"{stored} differs from BENCHMARKS.md: run python tests/test_docs.py"


def test_every_data_file_belongs_to_a_section_or_a_note():
    """Each file of docs/data/ is named by a section's Data bullet, or linked from a dated note (a run's
    raw results, a secondary table's data)."""
    named = {repo_path(m.group(2)) for lines in measured_sections().values()
             for m in LINK.finditer(bullets(lines).get("Data", ""))}
    named |= {repo_path(m.group(2), note.parent) for note in (DOCS / "notes").glob("*.md")
              for m in LINK.finditer(note.read_text())}
    stored = {str(p.relative_to(ROOT)) for p in (DOCS / "data").glob("*.json")}
    assert stored <= named, f"data files no section or note names: {sorted(stored - named)}"


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    for m in LINK.finditer(text):
        target, _, anchor = m.group(2).partition("#")
        if re.match(r"\w+://", target):
            continue
        path = (doc.parent / target).resolve() if target else doc
        assert path.exists(), f"{doc.name}: link to {m.group(2)} names no file"
        if anchor:
            assert anchor in {slug(h) for h in headings(path)}, f"{doc.name}: no heading #{anchor} in {path.name}"


def module_exists(dotted: str) -> bool:
    """``pkg.mod.attr``: the longest prefix that is a module, and the rest named in its source."""
    parts = dotted.removesuffix("()").split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            rest = parts[n:]
            return len(rest) <= 2 and (not rest or re.search(rf"\b{rest[0]}\b", source.read_text()) is not None)
    return False


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_named_in_docs_exists(doc):
    for token in re.findall(r"`([^`\s]+)`", doc.read_text()):
        token = token.rstrip(".,:;")
        if re.search(r"[*<>{}…]", token):
            continue
        if token.split("/")[0] in TOP_DIRS and "/" in token:
            assert (ROOT / token).exists(), f"{doc.name} names {token}, which does not exist"
        elif re.fullmatch(rf"({'|'.join(PACKAGES)})(\.\w+)+(\(\))?", token) and token not in NOT_MODULES:
            assert module_exists(token), f"{doc.name} names {token}, which no module defines"
    for m in re.finditer(rf"(?:^|[\s(])((?:{'|'.join(map(re.escape, TOP_DIRS))})/[\w./-]+)", doc.read_text(), flags=re.M):
        path = m.group(1).rstrip(".,;:")
        assert (ROOT / path).exists(), f"{doc.name} names {path}, which does not exist"


def test_code_points_to_existing_doc_sections():
    """A comment that cites docs/BENCHMARKS.md names one of its sections; cited notes exist."""
    titles = set(sections())
    files = [p for folder in (*PACKAGES, "benchmarks", "scripts") for p in sorted((ROOT / folder).rglob("*"))
             if p.suffix in (".py", ".toml", ".sh")]
    for path in files:
        text = path.read_text()
        for m in re.finditer(r"BENCHMARKS\.md", text):
            cited = re.match(r"[^\"]{0,16}\"([^\"]+)\"", text[m.end():])
            assert cited and cited.group(1) in titles, (
                f"{path.relative_to(ROOT)} cites docs/BENCHMARKS.md without one of its section titles in quotes")
        for note in re.findall(r"docs/notes/[\w.-]+\.md", text):
            assert (ROOT / note).is_file(), f"{path.relative_to(ROOT)} cites {note}, which does not exist"


if __name__ == "__main__":
    write_data_files()
