"""What W4A8 (int8 activations, ``int4_compute = "w4a8"``) costs an INT4 artifact in quality, against W4A16.

    python benchmarks/int4_compute_quality.py ARTIFACT [ARTIFACT ...] [--windows 16] [--corpora pydoc,stdlib-docs]
        [--split evaluation] [--json out.json]

Each INT4 artifact is evaluated twice on the same held-out windows (512 tokens each): as the format
computes (W4A16; on these many-token windows the float32 dequantize arithmetic), and with every
INT4 layer on ``w4a8_linear`` (``Int4Linear.use_w4a8``, what the engine does for that plan). Per
corpus: perplexity, its change against float (the built-in ``--model``, whose logits are the KL
reference), mean per-token KL(float ‖ variant), top-1 agreement with float, and KL(W4A16 ‖ W4A8),
what the int8 activations alone add. ``--split validation`` is for choosing; ``evaluation`` (the
default) for the figures that are reported.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402
from calib import SPLITS, evaluation_windows  # noqa: E402
from compiler.io.artifact import load_artifact  # noqa: E402
from compiler.io.load import load_checkpoint  # noqa: E402
from compiler.kernels.w4a8_cpu import w4a8_unavailable_reason  # noqa: E402
from compiler.pipeline.evaluate import corpus_split  # noqa: E402
from passes.distill.evaluate import compare_on_windows, teacher_logits  # noqa: E402
from serving.engine_setup import set_int4_compute  # noqa: E402


def with_w4a8(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with every INT4 layer on int8 activations, as the engine puts them
    (``set_int4_compute``); refuses a model where a layer cannot."""
    model = copy.deepcopy(model)
    report = set_int4_compute(model, "w4a8", torch.device("cpu"))
    if report.get("w4a16"):
        raise SystemExit(f"layers that cannot run W4A8: {report['w4a16']}")
    return model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+", type=Path, help="INT4 artifacts (e.g. qcompile compile -c examples/awq_g128.toml)")
    ap.add_argument("--model", default="smollm2", help="the float model the artifacts were compiled from")
    ap.add_argument("--windows", type=int, default=16, help="per corpus (stdlib-docs holds 15 per region)")
    ap.add_argument("--corpora", default="pydoc,stdlib-docs", help="comma-separated held-out corpora")
    ap.add_argument("--split", default="evaluation", choices=SPLITS,
                    help="validation to choose settings on, evaluation for figures that are reported")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    if why := w4a8_unavailable_reason():
        raise SystemExit(f"W4A8 cannot run here: {why}")
    console = Console(width=200)
    source = load_checkpoint(args.model)
    rows = []
    for corpus in args.corpora.split(","):
        region = corpus_split(source.tokenizer, corpus).region(args.split)
        windows = evaluation_windows(region, min(args.windows, len(region) // 512), 512)
        reference = teacher_logits(source.model, windows)
        for artifact in args.artifacts:
            w4a16 = load_artifact(artifact).model
            w4a8 = with_w4a8(w4a16)
            scores = {"w4a16": compare_on_windows(source.model, w4a16, windows, reference=reference),
                      "w4a8": compare_on_windows(source.model, w4a8, windows, reference=reference)}
            added = compare_on_windows(w4a16, w4a8, windows)
            for compute, s in scores.items():
                rows.append({"artifact": str(artifact), "corpus": corpus, "windows": len(windows), "compute": compute,
                             "ppl": s["ppl_student"], "ppl_float": s["ppl_teacher"], "kl_vs_float": s["kl"],
                             "top1_vs_float": s["top1_agreement"],
                             "kl_vs_w4a16": added["kl"] if compute == "w4a8" else 0.0})
                console.print(f"{artifact} {compute} on {corpus}: ppl {s['ppl_student']:.4f}, KL {s['kl']:.5f}")
    console.print(results_table(rows))
    return write_result(args.json, rows, model=args.model, split=args.split)


def results_table(rows: list[dict]) -> Table:
    table = Table(title="INT4 compute: W4A16 (the format) against W4A8 (int8 activations)")
    for col in ("artifact", "corpus", "compute", "perplexity", "Δ vs float", "KL vs float", "top-1 vs float", "KL vs W4A16"):
        table.add_column(col, justify="left" if col in ("artifact", "corpus", "compute") else "right")
    for r in rows:
        table.add_row(Path(r["artifact"]).name, f"{r['corpus']} ({r['windows']})", r["compute"], f"{r['ppl']:.4f}",
                      f"{100 * (r['ppl'] / r['ppl_float'] - 1):+.2f}%", f"{r['kl_vs_float']:.5f}",
                      f"{100 * r['top1_vs_float']:.1f}%", f"{r['kl_vs_w4a16']:.5f}" if r["compute"] == "w4a8" else "—")
    return table


if __name__ == "__main__":
    main()
