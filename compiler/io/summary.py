"""What ``qcompile inspect`` (and ``qcompile.inspect``) reports about an artifact, read from its
manifest alone (the weights are not read): passes, formats, per-layer sizes and bits per weight,
for INT4 layers what the engine's CPU forward runs on this machine under the artifact's serving
plan (``cpu_kernel``, with the ISA level of qcompile's kernels: ``cpu_isa``), and the layers whose
quantization costs most (``sensitive``: by the passes' ``kl_alone`` where measured, else ``output_error``)."""
from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from compiler.io.artifact import read_manifest
from compiler.io.shards import weight_files
import torch

from compiler.kernels.cpu_ext import cpu_isa_in_use
from compiler.kernels.dispatch import W4A8, resolve_int4_compute
from compiler.kernels.int4_cpu import KERNEL, layer_unsupported_reason
from compiler.kernels.w4a8_cpu import layer_unsupported_reason as w4a8_layer_reason

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
                "uint8": 1, "int8": 1, "int32": 4, "int64": 8, "bool": 1}


def artifact_summary(path: str | Path) -> dict:
    """Everything ``inspect`` shows, computed from the manifest (weights are not read)."""
    path = Path(path)
    record = read_manifest(path)
    module_bytes: dict[str, int] = defaultdict(int)
    weight_shape: dict[str, list[int]] = {}
    for name, t in record.tensors.items():
        module, _, leaf = name.rpartition(".")
        n = 1
        for d in t["shape"]:
            n *= d
        module_bytes[module] += n * _DTYPE_BYTES.get(t["dtype"], 4)
        if leaf == "weight" and len(t["shape"]) == 2:
            weight_shape[module] = t["shape"]
    int4_compute, _ = resolve_int4_compute((record.serving or {}).get("int4_compute", "auto"), torch.device("cpu"))
    layers = []
    for module in sorted(set(weight_shape) | set(record.modules)):
        meta = record.modules.get(module, {"format": record.dtype_name})
        out_f, in_f = (meta["out_features"], meta["in_features"]) if "in_features" in meta else weight_shape[module]
        layer = {"module": module, **meta, "bytes": module_bytes[module],
                 "bits_per_weight": round(8 * module_bytes[module] / (in_f * out_f), 3)}
        if meta["format"] == "int4":
            layer["cpu_kernel"] = _int4_cpu_kernel(meta, out_f, int4_compute)
        layers.append(layer)
    weights_bytes = sum(f.stat().st_size for f in weight_files(path))
    return {
        "path": str(path),
        "source": record.source.to_dict(),
        "passes": [{"name": r["name"], "wall_time_s": r["wall_time_s"], "metrics": r["metrics"], "notes": r.get("notes", [])}
                   for r in record.reports],
        "formats": dict(Counter(layer["format"] for layer in layers)),
        "cpu_isa": cpu_isa_in_use(),
        "layers": layers,
        "sensitive": most_sensitive(record.reports),
        "size": {"weights_bytes": weights_bytes,
                 "total_bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
                 "source_bytes": record.source.size_bytes},
    }


def _int4_cpu_kernel(meta: dict, out_features: int, int4_compute: str) -> str:
    """What an INT4 layer's decode-step forward runs on this CPU under ``int4_compute`` (resolved)."""
    if int4_compute == "w4a8" and not w4a8_layer_reason(meta["group_size"]):
        return W4A8.describe()
    why = layer_unsupported_reason(out_features, meta["padded_in_features"], meta["group_size"])
    return f"reference: {why}" if why else KERNEL


SENSITIVE_SHOWN = 10


def most_sensitive(reports: list[dict], top: int = SENSITIVE_SHOWN) -> list[dict]:
    """The ``top`` converted layers that cost most, from the pass reports' rows (a later pass's row of a
    module replaces an earlier one's): by ``kl_alone`` (the end-to-end KL of the layer alone quantized)
    when any row has it, else by ``output_error``."""
    rows: dict[str, dict] = {}
    for report in reports:
        for row in report.get("layers", []):
            metrics = row.get("metrics", {})
            if row["format"] != "float" and metrics.get("output_error") is not None:
                rows[row["module"]] = {"module": row["module"], "format": row["format"], "pass": report["name"],
                                       "output_error": metrics["output_error"], "kl_alone": metrics.get("kl_alone")}
    key = "kl_alone" if any(r["kl_alone"] is not None for r in rows.values()) else "output_error"
    ranked = sorted((r for r in rows.values() if r[key] is not None), key=lambda r: r[key], reverse=True)
    return ranked[:top]
