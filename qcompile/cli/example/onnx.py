"""The main job's ONNX stage: lower each example artifact to ONNX and check it against torch.

The check is of the lowering, so both sides compute the format's exact numerics: MatMulNBits at
accuracy_level 0 (float32; ``qcompile lower`` defaults to 4, int8 compute, for speed) against
``Int4Linear``'s dequantize reference (not the CPU kernel's bfloat16 rounding)."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from compiler.io.artifact import load_artifact, read_manifest
from compiler.kernels.int4_cpu import reference_only

GREEDY_TOKENS = 16


def stage_rows(rows: list[dict]) -> list[dict]:
    """The float baseline and the first INT4 artifact (MatMulNBits): enough to show both paths
    while keeping the example short (each lowering of SmolLM2 takes ~20 s on 2 cores)."""
    int4 = [r for r in rows[1:] if any(m.get("format") == "int4" for m in read_manifest(r["path"]).modules.values())]
    return rows[:1] + int4[:1]


def run_onnx_stage(console: Console, rows: list[dict], out_dir: Path, prompt: str) -> list[dict]:
    """For the float and first INT4 artifact: lower to ONNX, compare prompt logits and greedy tokens with torch."""
    from backends.onnx.export import OnnxExportOptions, export_onnx
    from backends.onnx.runner import OnnxRunner

    results = []
    for row in stage_rows(rows):
        loaded = load_artifact(row["path"])
        ids = torch.tensor([loaded.tokenizer(prompt)["input_ids"]])
        console.print(f"lowering [bold]{row['variant']}[/bold] to ONNX …")
        start = time.perf_counter()
        bundle = out_dir / f"{row['variant']}-onnx"
        opts = OnnxExportOptions(max_len=ids.shape[1] + GREEDY_TOKENS + 1, accuracy_level=0)
        info = export_onnx(loaded, bundle, opts, force=True)
        lower_s = time.perf_counter() - start
        runner = OnnxRunner(bundle)
        with torch.no_grad(), reference_only():
            ref = loaded.model(ids).numpy()
            expected = loaded.model.generate(ids, GREEDY_TOKENS).numpy()
        got = runner.prefill(ids.numpy())
        rel = float(np.abs(got - ref).max() / np.abs(ref).max()) if not np.isnan(got).any() else float("inf")
        same = np.array_equal(runner.generate(ids.numpy(), GREEDY_TOKENS), expected)
        kinds = sorted(set(info.layers.values())) or ["float MatMul"]
        results.append({"variant": row["variant"], "rel_error": rel, "greedy_same": same, "lower_s": lower_s,
                        "layers": ", ".join(kinds), "path": str(bundle)})
    _print(console, results, prompt)
    return results


def _print(console: Console, results: list[dict], prompt: str) -> None:
    table = Table(title=f"ONNX Runtime vs torch on {prompt!r}")
    for col in ("variant", "logits rel. error", f"greedy {GREEDY_TOKENS} tokens", "lower s", "linear layers as", "bundle"):
        table.add_column(col, justify="right" if col in ("logits rel. error", "lower s") else "left")
    for r in results:
        table.add_row(r["variant"], f"{r['rel_error']:.1e}", "identical" if r["greedy_same"] else "DIFFERENT",
                      f"{r['lower_s']:.1f}", r["layers"], r["path"])
    console.print(table)
