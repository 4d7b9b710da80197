r"""KL divergence from float by recipe: llama.cpp's statistics (``qcompile eval --reference``) of each
compressed model against its float source, on the same windows of each corpus.

    python benchmarks/kl_quality.py                                  # SmolLM2: RTN, AWQ g128/g64, FP8, mixed 4.5 bits
    python benchmarks/kl_quality.py --model gemma3-270m --samples 32 --recipes rtn:128,rtn:64,awq:128,awq:64,fp8,mixed:4.5:bfloat16
    python benchmarks/kl_quality.py --recipes rtn:128,awq:128,examples/awq_g128_w4a8.toml --corpora pydoc

Recipes: ``rtn:G`` (round to nearest, the AWQ pass's layers and group-size fallback, no search: not
written), ``awq:G`` (``examples/awq_g128.toml`` at group size G), ``fp8`` (``examples/fp8.toml``),
``mixed:B`` (``examples/awq_mixed_4p5.toml`` at ``average_bits = B``, float16 as the example;
``mixed:B:bfloat16`` in bfloat16, for Gemma 3, which float16 overflows), or a pipeline TOML
(``examples/float.toml::bfloat16``: no pass, the model in bfloat16, what that dtype alone costs). Every
pipeline runs at ``--samples`` calibration windows and is compiled, written and reloaded before it
is scored. Each recipe runs in its own subprocess (its compile time and peak RSS
its own); the float row saves one reference file per corpus (``compiler/io/kl_reference.py``) that
every other row is scored against. Bits per weight: the converted layers' stored bits over their
weights (``qcompile inspect``), float layers (the embedding, lm_head) not counted.
"RTN's increase removed" = 1 - (ppl - ppl_float) / (ppl_rtn - ppl_float), against RTN at the row's
group size (at 128 for ``mixed``). A run whose ``--json`` file exists keeps the rows it holds for the
same protocol (a resumed run).
"""
from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import read_result, write_result  # noqa: E402

NAMED_RECIPES = {"awq": "examples/awq_g128.toml", "fp8": "examples/fp8.toml", "mixed": "examples/awq_mixed_4p5.toml"}
DEFAULT_RECIPES = "rtn:128,rtn:64,awq:128,awq:64,fp8,mixed:4.5"


def pipeline_for(recipe: str, samples: int) -> dict:
    """The pipeline table a recipe names, with ``samples`` calibration windows."""
    name, arg, dtype = (recipe.split(":") + ["", ""])[:3]
    path = ROOT / NAMED_RECIPES[name] if name in NAMED_RECIPES else Path(name)
    if not path.is_file():
        raise SystemExit(f"unknown recipe {recipe!r}: give rtn:G, awq:G, fp8, mixed:BITS[:DTYPE] or a pipeline .toml file")
    table = tomllib.loads(path.read_text())
    table["calibration"]["samples"] = samples
    if dtype:
        table["model"]["dtype"] = dtype
    if name == "awq" and arg:
        table["passes"][0]["group_size"] = int(arg)
    if name == "mixed" and arg:
        table["passes"][0]["average_bits"] = float(arg)
    return table


def converted_bits(layers: list[dict]) -> float | None:
    """Stored bits per weight over the converted (non-float) layers of ``qcompile inspect``'s rows;
    None where every layer is float."""
    converted = [layer for layer in layers if layer["format"] not in ("float32", "float16", "bfloat16")]
    weights = sum(layer["out_features"] * layer["in_features"] for layer in converted)
    return sum(8 * layer["bytes"] for layer in converted) / weights if weights else None


def rtn_model(model_name: str, group_size: int):
    """RTN at ``group_size``: the AWQ pass's layers and fallback, nearest rounding, no search."""
    from compiler.formats.int4 import Int4Linear
    from compiler.io.load import load_checkpoint
    from passes.awq import stored_bits
    from passes.awq_plan import AWQOptions, plan_layers

    loaded = load_checkpoint(model_name)
    plans, _ = plan_layers(loaded.model, AWQOptions(group_size=group_size))
    bits = weights = 0
    for name, plan in plans.items():
        layer = Int4Linear.from_float(loaded.model.get_submodule(name), plan.group_size)
        loaded.model.set_submodule(name, layer)
        bits, weights = bits + stored_bits(layer), weights + layer.in_features * layer.out_features
    return loaded, bits / weights


def run_one(model_name: str, recipe: str, samples: int, windows: int, corpora: list[str], split: str,
            workdir: Path) -> dict:
    """One recipe's row: compile (or RTN), then the KL statistics on each corpus against the float reference."""
    import qcompile

    qcompile.load_plugins()
    wall, cpu = time.perf_counter(), _cpu_s()
    bits = None
    if recipe == "float":
        candidate = qcompile.load(model_name)
    elif recipe.startswith("rtn:"):
        candidate, bits = rtn_model(model_name, int(recipe[4:]))
    else:
        out = Path(tempfile.mkdtemp(dir=workdir)) / "artifact"
        qcompile.compile(model_name, pipeline_for(recipe, samples), out, streaming="off")
        candidate = qcompile.load(out)  # scored as reloaded from the artifact
        bits = converted_bits(qcompile.inspect(out)["layers"])
    compile_wall, compile_cpu = time.perf_counter() - wall, _cpu_s() - cpu
    stats = {}
    for corpus in corpora:
        n = windows_held(candidate.tokenizer, corpus, windows, split)
        reference = reference_path(workdir, corpus, n, split)
        if recipe == "float":
            stats[corpus] = qcompile.evaluate(candidate, corpus, n, split, reference=candidate,
                                              save_reference=reference)
        else:
            stats[corpus] = qcompile.evaluate(candidate, corpus, n, split, reference=reference)
    calibrated = recipe != "float" and not recipe.startswith("rtn:")
    return {"model": model_name, "recipe": recipe, "bits_per_weight": bits, "samples": samples if calibrated else None,
            "windows": windows,
            "split": split, "compile_wall_s": compile_wall, "compile_cpu_s": compile_cpu,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "by_corpus": {c: _kept(s) for c, s in stats.items()}}


def windows_held(tokenizer, corpus: str, windows: int, split: str) -> int:
    """``windows``, or all the ``split`` region of ``corpus`` holds if fewer (stdlib-docs holds 15)."""
    from compiler.pipeline.evaluate import corpus_split

    return min(windows, len(corpus_split(tokenizer, corpus).region(split)) // 512)


def reference_path(workdir: Path, corpus: str, windows: int, split: str) -> Path:
    return workdir / f"reference-{re.sub(r'[^A-Za-z0-9_.-]', '_', corpus)}-{split}-{windows}.kref"


def _kept(stats: dict) -> dict:
    """The statistics the table and its JSON keep (numbers only)."""
    return {k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _child(args, recipe: str, workdir: Path) -> dict:
    cmd = [sys.executable, __file__, "--model", args.model, "--one", recipe, "--samples", str(args.samples),
           "--windows", str(args.windows), "--corpora", args.corpora, "--split", args.split, "--workdir", str(workdir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{recipe} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kept_rows(path: Path, protocol: dict) -> dict[str, dict]:
    """The rows of an earlier run of the same protocol, by recipe; float and RTN rows calibrate on
    nothing (``samples`` None), so they are kept whatever its ``samples``."""
    doc = read_result(path)
    if any(doc.get(k) != v for k, v in protocol.items() if k != "samples"):
        return {}
    return {r["recipe"]: r for r in doc["rows"] if r["samples"] in (None, protocol["samples"])}


def markdown_table(rows: list[dict]) -> str:
    """Each recipe's bits, and on each corpus its perplexity (Δ from float), the share of RTN's
    increase it removes, mean KLD ± its uncertainty and the same-top-token share."""
    corpora = list(rows[0]["by_corpus"])
    header = "".join(f" {c} PPL (Δ) | {c} RTN's increase removed | {c} mean KLD | {c} same top p |" for c in corpora)
    lines = [f"| recipe | bits per weight |{header}", "|---|---|" + "---|---|---|---|" * len(corpora)]
    for r in rows:
        bits = "" if r["bits_per_weight"] is None else f"{r['bits_per_weight']:.2f}"
        lines.append(f"| {r['recipe']} | {bits} |" + "".join(_cells(rows, r, c) for c in corpora))
    return "\n".join(lines)


def _cells(rows: list[dict], row: dict, corpus: str) -> str:
    s, base = row["by_corpus"][corpus], rows[0]["by_corpus"][corpus]["ppl"]
    name, _, arg = row["recipe"].partition(":")
    group = arg.split(":")[0] if name in ("rtn", "awq") else "128" if name == "mixed" else None
    rtn = {r["recipe"][4:]: r["by_corpus"][corpus]["ppl"] for r in rows if r["recipe"].startswith("rtn:")}
    removed = f"{1 - (s['ppl'] - base) / (rtn[group] - base):.0%}" if name != "rtn" and group in rtn else ""
    if row["recipe"] == "float":
        return f" {s['ppl']:.3f} | | | |"
    return (f" {s['ppl']:.3f} ({100 * (s['ppl'] / base - 1):+.2f}%) | {removed} | "
            f"{s['kld_mean']:.4f} ± {s['kld_mean_uncertainty']:.4f} | {100 * s['same_top']:.2f} % |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a built-in model (smollm2, gemma3-270m) or a checkpoint path")
    ap.add_argument("--recipes", default=DEFAULT_RECIPES, help="comma-separated; the float row is always first")
    ap.add_argument("--samples", type=int, default=128, help="calibration windows × 512 tokens of every pipeline")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--corpora", default="pydoc,stdlib-docs")
    ap.add_argument("--split", default="evaluation", choices=("evaluation", "validation"))
    ap.add_argument("--workdir", type=Path, help="reference files and artifacts (default: a temporary folder)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    corpora = args.corpora.split(",")
    if args.one:
        print(json.dumps(run_one(args.model, args.one, args.samples, args.windows, corpora, args.split, args.workdir)))
        return
    recipes = ["float"] + [r for r in args.recipes.split(",") if r != "float"]
    for recipe in recipes[1:]:
        if not recipe.startswith("rtn:"):
            pipeline_for(recipe, args.samples)  # an unknown recipe stops here, before any work
    protocol = {"model": args.model, "samples": args.samples, "windows": args.windows, "split": args.split,
                "corpora": corpora}
    done = kept_rows(args.json, protocol) if args.json and args.json.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        rows = []
        for recipe in recipes:
            rows.append(done.get(recipe) or _child(args, recipe, workdir))
            print(json.dumps(rows[-1]), flush=True)  # each row as soon as it exists
            if args.json:
                write_result(args.json, rows, **protocol)
    print(f"\n{args.model}, {args.split} split, up to {args.windows} windows × 512 tokens per corpus:\n{markdown_table(rows)}")


if __name__ == "__main__":
    main()
