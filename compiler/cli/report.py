"""Tables for pass reports and artifact summaries (``qcompile compile`` / ``inspect``)."""
from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from compiler.artifact import WEIGHTS, read_manifest

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
                "uint8": 1, "int8": 1, "int32": 4, "int64": 8, "bool": 1}


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


def artifact_summary(path: str | Path) -> dict:
    """Everything ``inspect`` shows, computed from the manifest (weights are not read)."""
    path = Path(path)
    manifest = read_manifest(path)
    module_bytes: dict[str, int] = defaultdict(int)
    weight_shape: dict[str, list[int]] = {}
    for name, t in manifest["tensors"].items():
        module, _, leaf = name.rpartition(".")
        n = 1
        for d in t["shape"]:
            n *= d
        module_bytes[module] += n * _DTYPE_BYTES.get(t["dtype"], 4)
        if leaf == "weight" and len(t["shape"]) == 2:
            weight_shape[module] = t["shape"]
    layers = []
    for module in sorted(set(weight_shape) | set(manifest["modules"])):
        meta = manifest["modules"].get(module, {"format": manifest["dtype"]})
        out_f, in_f = (meta["out_features"], meta["in_features"]) if "in_features" in meta else weight_shape[module]
        layers.append({"module": module, **meta, "bytes": module_bytes[module],
                       "bits_per_weight": round(8 * module_bytes[module] / (in_f * out_f), 3)})
    weights_bytes = (path / WEIGHTS).stat().st_size
    return {
        "path": str(path),
        "source": manifest["source"],
        "passes": [{"name": r["name"], "wall_time_s": r["wall_time_s"], "metrics": r["metrics"], "notes": r.get("notes", [])}
                   for r in manifest["passes"]],
        "formats": dict(Counter(layer["format"] for layer in layers)),
        "layers": layers,
        "size": {"weights_bytes": weights_bytes,
                 "total_bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
                 "source_bytes": manifest["source"].get("size_bytes", 0)},
    }


def print_summary(console: Console, s: dict) -> None:
    console.print(f"[bold]{s['path']}[/bold]  (source: {s['source']['path']}, sha256 {s['source']['sha256'][:12]}…)")
    print_reports(console, s["passes"])
    table = Table(title="layers")
    for col in ("module", "format", "group", "bits/weight", "MiB"):
        table.add_column(col, justify="right" if col != "module" else "left")
    for layer in s["layers"]:
        table.add_row(layer["module"], layer["format"], _fmt(layer.get("group_size", "")),
                      f"{layer['bits_per_weight']:.2f}", f"{layer['bytes'] / 2**20:.2f}")
    console.print(table)
    size = s["size"]
    formats = ", ".join(f"{k}: {v}" for k, v in s["formats"].items())
    console.print(f"formats: {formats}")
    console.print(f"size on disk: weights {size['weights_bytes'] / 2**20:.1f} MiB, artifact {size['total_bytes'] / 2**20:.1f} MiB; "
                  f"source checkpoint {size['source_bytes'] / 2**20:.1f} MiB")
