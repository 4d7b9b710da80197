"""Perplexity of FP8 variants of SmolLM2-135M (or ``--model``) against float, by the shared pydoc protocol.

Each variant is compiled from the same loaded checkpoint, written as an artifact, reloaded
(so the figure is the artifact's, FP8 KV rounding included) and evaluated on the first
``--windows`` evaluation windows: perplexity, its change against the float baseline measured in
the same run, and the mean per-token KL(float ‖ variant) with top-1 agreement, which separate
variants more steadily than a perplexity change of a few tenths of a percent does.

    python benchmarks/fp8_quality.py --windows 16 --samples 16
    python benchmarks/fp8_quality.py --only w8a8-dynamic kv-e4m3   # a subset
    python benchmarks/fp8_quality.py --split validation --corpora pydoc,stdlib-docs   # to choose on
    python benchmarks/fp8_quality.py --split validation --corpora pydoc,stdlib-docs --calibration pydoc+stdlib-docs
    python benchmarks/fp8_quality.py --model gemma3-270m --only w8a8-dynamic          # the second real model
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import passes  # noqa: E402,F401  (registers the fp8 pass)
from benchmarks.common import write_result  # noqa: E402
from calib import SPLITS, evaluation_windows  # noqa: E402
from compiler.io.artifact import load_artifact  # noqa: E402
from compiler.io.load import load_checkpoint  # noqa: E402
from compiler.io.summary import artifact_summary  # noqa: E402
from compiler.pipeline import PipelineConfig  # noqa: E402
from compiler.pipeline.compile import compile_loaded  # noqa: E402
from compiler.pipeline.evaluate import corpus_split  # noqa: E402
from passes.distill.evaluate import compare_on_windows, teacher_logits  # noqa: E402

E5M2 = {"weight_dtype": "float8_e5m2", "activation_dtype": "float8_e5m2"}
# label -> fp8 pass options (None: the float baseline, no passes)
VARIANTS = {  # the four figures first, then the other options
    "float": None,
    "w8a8-dynamic": {},
    "w8a8-dynamic-group64": {"activation_group_size": 64},  # per token and 64 channels (64 divides 576, 1536)
    "w8a8-static-absmax": {"activation_scheme": "static"},
    # the 32 input channels of largest variance per layer in the model dtype (QUIK), the rest as above
    "w8a8-dynamic-outliers32": {"outlier_channels": 32},
    "w8a8-dynamic-outliers64": {"outlier_channels": 64},
    "w8a8-dynamic-group64-outliers32": {"activation_group_size": 64, "outlier_channels": 32},
    "w8a8-static-outliers32": {"activation_scheme": "static", "outlier_channels": 32},
    # without the default input_shift (each input channel's calibration mean subtracted, OS+)
    "w8a8-dynamic-noshift": {"input_shift": False},
    "w8a8-static-noshift": {"activation_scheme": "static", "input_shift": False},
    "kv-e4m3-per-head": {"convert_linears": False, "kv_cache_dtype": "float8_e4m3fn"},
    "e5m2-w8a8-dynamic": E5M2,
    "w8a8-static-pct99.9": {"activation_scheme": "static", "static_calibration": "percentile"},
    "w8a8-per-tensor-static": {"activation_scheme": "static", "granularity": "per_tensor"},
    "w8a8-dynamic+kv": {"kv_cache_dtype": "float8_e4m3fn"},
    "kv-e4m3-per-tensor": {"convert_linears": False, "kv_cache_dtype": "float8_e4m3fn", "kv_cache_granularity": "per_tensor"},
    "kv-e5m2-per-head": {"convert_linears": False, "kv_cache_dtype": "float8_e5m2"},
    "w8-only": {"activation_scheme": "none"},
    # round-to-nearest weights (weight_rounding = "nearest") instead of GPTQ's, for comparison
    "w8a8-dynamic-nearest": {"weight_rounding": "nearest"},
    "w8a8-static-absmax-nearest": {"activation_scheme": "static", "weight_rounding": "nearest"},
    "w8-only-nearest": {"activation_scheme": "none", "weight_rounding": "nearest"},
}


def variant_config(options: dict | None, samples: int, calibration: str = "pydoc") -> PipelineConfig:
    d = {"calibration": {"corpus": calibration, "samples": samples, "seq_len": 512, "seed": 0}}
    d["passes"] = [] if options is None else [{"name": "fp8", **options}]
    return PipelineConfig.from_dict(d)


# Float logits are kept across variants up to this size; above it (Gemma 3's 262k vocabulary: 8.6 GB
# for 16 windows) the float model runs again beside each variant, one window at a time.
REFERENCE_CACHE_BYTES = 2 * 2**30


def held_out_sets(source, corpora: list[str], split: str, windows: int) -> dict[str, tuple[torch.Tensor, list | None]]:
    """corpus -> (its first ``windows`` windows of ``split``, or all it holds if fewer; the float logits on them, or None)."""
    sets = {}
    for corpus in corpora:
        region = corpus_split(source.tokenizer, corpus).region(split)
        batch = evaluation_windows(region, min(windows, len(region) // 512), 512)
        cached = batch.numel() * source.model.config.vocab_size * 4 <= REFERENCE_CACHE_BYTES
        sets[corpus] = batch, teacher_logits(source.model, batch) if cached else None
    return sets


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a built-in model (smollm2, gemma3-270m) or a checkpoint path")
    ap.add_argument("--windows", type=int, default=16, help="per corpus (stdlib-docs holds 15 per region)")
    ap.add_argument("--samples", type=int, default=16, help="calibration windows of 512 tokens")
    ap.add_argument("--only", nargs="*", choices=list(VARIANTS), help="variants besides float")
    ap.add_argument("--corpora", default="pydoc", help="comma-separated held-out corpora")
    ap.add_argument("--calibration", default="pydoc", help="the calibration corpus ('a+b' mixes corpora)")
    ap.add_argument("--split", default="evaluation", choices=SPLITS,
                    help="validation to choose settings on, evaluation for figures that are reported")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    console = Console(width=200)
    source = load_checkpoint(args.model)
    labels = ["float"] + [v for v in (args.only or VARIANTS) if v != "float"]
    sets = held_out_sets(source, args.corpora.split(","), args.split, args.windows)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label in labels:
            start = time.perf_counter()
            variant = copy.copy(source)
            variant.model = copy.deepcopy(source.model)
            result = compile_loaded(variant, variant_config(VARIANTS[label], args.samples, args.calibration), Path(tmp) / label)
            compile_s = time.perf_counter() - start
            model = load_artifact(result.path).model
            summary = artifact_summary(result.path)
            fp8 = [layer for layer in summary["layers"] if layer["format"] == "fp8"]
            metrics = result.reports[0].metrics if result.reports else {}
            for corpus, (windows, reference) in sets.items():
                scores = compare_on_windows(source.model, model, windows, reference=reference,
                                            batch_size=4 if reference is not None else 1)
                rows.append({"variant": label, "calibration": args.calibration, "corpus": corpus, "windows": len(windows), "ppl": scores["ppl_student"],
                             "kl": scores["kl"], "top1": scores["top1_agreement"],
                             "mib": summary["size"]["weights_bytes"] / 2**20, "fp8_layers": len(fp8),
                             "fallback": metrics.get("fallback", 0),
                             "fp8_bits": sum(layer["bits_per_weight"] for layer in fp8) / len(fp8) if fp8 else None,
                             "compile_s": compile_s})
                console.print(f"{label} on {corpus}: ppl {scores['ppl_student']:.4f}, KL {scores['kl']:.5f}, "
                              f"top-1 {scores['top1_agreement']:.4f}")
            del model
    console.print(results_table(rows, args))
    return write_result(args.json, rows, model=args.model, split=args.split, samples=args.samples)


def results_table(rows: list[dict], args) -> Table:
    table = Table(title=f"{args.model}, {args.split} split, windows × 512 tokens, calibration {args.samples} × 512 (pydoc)")
    for col in ("variant", "corpus", "windows", "perplexity", "Δ vs float", "KL vs float", "top-1", "fp8 layers",
                "fallback", "bits/weight (fp8 layers)", "weights MiB", "compile s"):
        table.add_column(col, justify="left" if col in ("variant", "corpus") else "right")
    base = {r["corpus"]: r["ppl"] for r in rows if r["variant"] == "float"}
    for r in rows:
        table.add_row(r["variant"], r["corpus"], str(r["windows"]), f"{r['ppl']:.3f}",
                      f"{100 * (r['ppl'] / base[r['corpus']] - 1):+.2f}%", f"{r['kl']:.4f}", f"{100 * r['top1']:.1f}%",
                      str(r["fp8_layers"]), str(r["fallback"]), f"{r['fp8_bits']:.2f}" if r["fp8_bits"] else "-",
                      f"{r['mib']:.1f}", f"{r['compile_s']:.0f}")
    return table


if __name__ == "__main__":
    main()
