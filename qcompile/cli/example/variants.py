"""The example's variants: each a pipeline file run on its own input, evaluated, and shown beside it.

A variant starts from the float checkpoint or from the artifact of an earlier variant (the
distilled one from the AWQ artifact, so the table shows what the distillation stage itself did,
with the same calibration on both rows).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from rich.console import Console
from rich.table import Table

from compiler.io.artifact import load_artifact
from compiler.io.summary import artifact_summary
from compiler.io.types import LoadedModel
from compiler.pipeline import PipelineConfig
from compiler.pipeline.compile import compile_loaded
from compiler.pipeline.evaluate import evaluate_perplexity


@dataclass(frozen=True)
class Variant:
    """``pipeline`` (a file in ``examples/``) run on the checkpoint, or on the artifact of variant ``start``."""

    label: str
    pipeline: str
    start: str | None = None


# In the order the table shows them: the first is the baseline, and a variant that starts from
# another comes right after it.
VARIANTS = [
    Variant("float", "float.toml"),
    Variant("awq-g128-32samples", "awq_g128.toml"),
    Variant("awq-g128-32samples+distill", "distill_int4.toml", start="awq-g128-32samples"),
    Variant("fp8", "fp8.toml"),
]


def example_pipeline(name: str) -> Path:
    """A pipeline file shipped in the package (``qcompile/examples/``; ``examples/`` in a checkout)."""
    return Path(str(resources.files("qcompile") / "examples" / name))


def compile_variants(console: Console, source: LoadedModel, out_dir: Path, windows: int,
                     variants: list[Variant] = VARIANTS, corpus: str = "pydoc") -> list[dict]:
    """Compile each variant into ``out_dir/LABEL``, reload it from its artifact and evaluate it on the
    first ``windows`` evaluation windows of ``corpus``; one row per variant, in order."""
    rows: dict[str, dict] = {}
    for v in variants:
        config = PipelineConfig.from_toml(example_pipeline(v.pipeline))
        console.print(f"compiling [bold]{v.label}[/bold] ({v.pipeline}"
                      f"{f', from the {v.start} artifact' if v.start else ''}) …")
        start = time.perf_counter()
        if v.start:
            model = load_artifact(rows[v.start]["path"])  # a fresh copy of the input artifact
        else:
            model = copy.copy(source)
            model.model = copy.deepcopy(source.model)
        result = compile_loaded(model, config, out_dir / v.label, force=True)
        compile_s = time.perf_counter() - start
        ppl = evaluate_perplexity(load_artifact(result.path), corpus, windows)
        rows[v.label] = {"variant": v.label, "from": v.start, "ppl": ppl["ppl"], "tokens": ppl["tokens"],
                         "weights_mib": artifact_summary(result.path)["size"]["weights_bytes"] / 2**20,
                         "compile_s": compile_s, "path": str(result.path),
                         "stage": stage_note([r.to_dict() for r in result.reports])}
    return list(rows.values())


def stage_note(reports: list[dict]) -> str:
    """What a variant's own stage measured about itself (the distill pass's held-out KL), or ""."""
    notes = []
    for r in reports:
        m = r.get("metrics", {})
        if r["name"] == "distill":
            before, after = m["kl_before"], m["kl_after"]
            tokens = m["heldout"][next(iter(m["heldout"]))]["after"]["tokens"]
            notes.append(f"KL to teacher {before:.4f} → {after:.4f} ({100 * (after / before - 1):+.1f}%, "
                         f"{tokens} held-out tokens)")
    return "; ".join(notes)


def variants_table(rows: list[dict], title: str, source_name: str) -> Table:
    """Perplexity of each variant against the float baseline (the first row) and against its own input.

    A variant with no ``from`` ran on the checkpoint ``source_name``, which the float artifact
    holds unchanged, so its input's perplexity is the baseline's."""
    by_label = {r["variant"]: r for r in rows}
    base = rows[0]["ppl"]
    table = Table(title=title)
    columns = ("variant", "from", "perplexity", "Δ vs float", "Δ vs from", "weights MiB", "compile s",
               "stage report", "artifact")
    for col in columns:
        table.add_column(col, justify="left" if col in ("variant", "from", "stage report", "artifact") else "right")
    for r in rows:
        start = by_label[r["from"]]["ppl"] if r["from"] else base
        table.add_row(r["variant"], r["from"] or source_name, f"{r['ppl']:.3f}", _delta(r["ppl"], base),
                      _delta(r["ppl"], start), f"{r['weights_mib']:.1f}", f"{r['compile_s']:.1f}",
                      r["stage"] or "—", r["path"])
    return table


def _delta(ppl: float, reference: float) -> str:
    return f"{100 * (ppl / reference - 1):+.2f}%"
