"""Tables for pass reports and artifact summaries (``qcompile compile`` / ``inspect``)."""
from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.table import Table


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def print_reports(console: Console, reports: list[dict]) -> None:
    if not reports:
        console.print("no passes: float artifact (the baseline)")
        return
    table = Table(title="passes")
    for col in ("pass", "wall s", "metrics"):
        table.add_column(col)
    for r in reports:
        metrics = ", ".join(f"{k}={_fmt(v)}" for k, v in r["metrics"].items())
        table.add_row(r["name"], f"{r['wall_time_s']:.1f}", metrics)
    console.print(table)
    for r in reports:  # decisions worth reading (e.g. layers kept in float), not only numbers
        for note in r.get("notes", []):
            console.print(f"{r['name']}: {note}")


def print_summary(console: Console, s: dict) -> None:
    console.print(f"[bold]{s['path']}[/bold]  (source: {s['source']['path']}, sha256 {s['source']['sha256'][:12]}…)")
    print_reports(console, s["passes"])
    table = Table(title="layers")
    for col in ("module", "format", "group", "bits/weight", "MiB"):
        table.add_column(col, justify="right" if col != "module" else "left")
    for layer in s["layers"]:
        table.add_row(layer["module"], layer["format"], _fmt(layer.get("group_size", layer.get("block_type", ""))),
                      f"{layer['bits_per_weight']:.2f}", f"{layer['bytes'] / 2**20:.2f}")
    console.print(table)
    size = s["size"]
    formats = ", ".join(f"{k}: {v}" for k, v in s["formats"].items())
    console.print(f"formats: {formats}")
    cpu_kernels = Counter(layer["cpu_kernel"] for layer in s["layers"] if "cpu_kernel" in layer)
    for how, n in sorted(cpu_kernels.items()):
        console.print(f"INT4 on this CPU: {n} layers run {how}", markup=False)  # "[avx2]" is no markup
    console.print(f"qcompile's CPU kernels here: {s['cpu_isa'] or 'none'}")
    console.print(f"size on disk: weights {size['weights_bytes'] / 2**20:.1f} MiB, artifact {size['total_bytes'] / 2**20:.1f} MiB; "
                  f"source checkpoint {size['source_bytes'] / 2**20:.1f} MiB")
