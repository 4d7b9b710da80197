"""Perplexity of INT8 variants (the ``int8`` pass) of SmolLM2-135M or Gemma 3 270M against float, and
vLLM's perplexity on the export against ``qcompile eval``'s on the artifact.

Each variant is compiled from the same loaded checkpoint, saved, reloaded and evaluated on the first
``--windows`` windows of each corpus' ``--split`` region (stdlib-docs holds 15 per region):
perplexity, its change against float in the same run, the mean per-token KL(float ‖ variant) and
top-1 agreement (``fp8_quality.held_out_sets``, ``passes/distill/evaluate.compare_on_windows``).
With ``--vllm`` each W8A8 artifact is also lowered with ``--target vllm`` and served by vLLM CPU,
whose prompt log-probabilities give its perplexity on pydoc's evaluation windows
(``backends/vllm/evaluate.server_perplexity``), beside ``qcompile eval``'s on the same windows.
``--json`` is written after each variant; a run whose ``--json`` file exists keeps the variants it
finished under the same protocol (model, dtype, split, samples, windows, corpora): a resumed run.

    python benchmarks/int8_quality.py --split validation --only w8a8-dynamic w8a8-dynamic-smooth-norms   # choose
    python benchmarks/int8_quality.py --corpora pydoc,stdlib-docs --vllm --json docs/data/int8_quality_smollm2.json
    python benchmarks/int8_quality.py --model gemma3-270m --corpora pydoc,stdlib-docs
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import backends  # noqa: E402,F401  (registers the vllm target)
import passes  # noqa: E402,F401  (registers the int8 pass)
from benchmarks.common import read_result, result, write_result  # noqa: E402
from benchmarks.fp8_quality import held_out_sets  # noqa: E402
from calib import SPLITS, evaluation_windows  # noqa: E402
from compiler.io.artifact import load_artifact  # noqa: E402
from compiler.io.load import load_checkpoint  # noqa: E402
from compiler.pipeline import PipelineConfig  # noqa: E402
from compiler.pipeline.compile import compile_loaded  # noqa: E402
from compiler.pipeline.evaluate import corpus_split  # noqa: E402
from passes.distill.evaluate import compare_on_windows  # noqa: E402

EXAMPLE = tomllib.loads((ROOT / "examples" / "int8_w8a8.toml").read_text())["passes"][0]
# label -> int8 pass options over examples/int8_w8a8.toml's (None: the float baseline)
VARIANTS = {
    "float": None,
    "w8a8-dynamic": {},
    "w8a8-dynamic-smooth-norms": {"smoothing": "norms"},
    "w8a8-dynamic-no-smoothing": {"smoothing": "none"},
    "w8a8-dynamic-asymmetric": {"activation_symmetric": False},
    "w8a8-static": {"activation_scheme": "static", "activation_symmetric": False},
    "w8a8-static-search": {"activation_scheme": "static", "activation_symmetric": False, "static_range": "search"},
    "w8a16": {"activation_scheme": "none", "activation_symmetric": True, "smoothing": "none"},
}
# Static with the N units whose static range costs most kept dynamic (per token, symmetric)
VARIANTS |= {f"w8a8-static-dynamic{n}": {**VARIANTS["w8a8-static"], "dynamic_fallback": n} for n in (4, 8, 16)}
# The same with the rotate pass before the int8 pass (a folded rotation of the residual stream): a randomized
# Hadamard matrix, or (-orthogonal) a random orthogonal one.
VARIANTS |= {f"{label}-rotated": VARIANTS[label] for label in
             ("w8a8-dynamic", "w8a8-dynamic-asymmetric", "w8a8-static")}
VARIANTS["w8a8-dynamic-asymmetric-rotated-orthogonal"] = VARIANTS["w8a8-dynamic-asymmetric"]


def variant_config(label: str, samples: int, dtype: str) -> PipelineConfig:
    d = {"model": {"dtype": dtype}, "calibration": {"corpus": "pydoc", "samples": samples, "seq_len": 512, "seed": 0}}
    options = VARIANTS[label]
    d["passes"] = [] if options is None else [{**EXAMPLE, **options}]
    if "-rotated" in label:
        d["passes"].insert(0, {"name": "rotate", "rotation": "orthogonal" if label.endswith("-orthogonal") else "hadamard"})
    return PipelineConfig.from_dict(d)


def vllm_perplexity(artifact: Path, out: Path, windows: torch.Tensor) -> dict:
    """vLLM CPU's perplexity on ``windows`` from its prompt log-probabilities of the lowered export."""
    from backends.triton.runtime import free_port
    from backends.vllm.evaluate import server_perplexity
    from backends.vllm.runtime import VllmOptions, VllmServer, vllm_host
    from compiler.deploy.lowering import lower

    checkpoint = lower(artifact, "vllm", out / f"{artifact.name}-vllm").path
    opts = VllmOptions(checkpoint, port=free_port(), served_name="model", max_model_len=1024,
                       extra_args=["--enforce-eager"])
    with VllmServer(opts, log_path=out / f"{artifact.name}-vllm.log") as server:
        scores = server_perplexity(server.url, server.model, windows)
        return {**scores, "vllm_build": vllm_host(server.python).build}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a built-in model (smollm2, gemma3-270m) or a checkpoint path")
    ap.add_argument("--dtype", default="float32", help="the compile's model dtype")
    ap.add_argument("--windows", type=int, default=16, help="per corpus (stdlib-docs holds 15 per region)")
    ap.add_argument("--samples", type=int, default=32, help="calibration windows of 512 tokens")
    ap.add_argument("--only", nargs="*", choices=list(VARIANTS), help="variants besides float")
    ap.add_argument("--corpora", default="pydoc", help="comma-separated held-out corpora")
    ap.add_argument("--split", default="evaluation", choices=SPLITS,
                    help="validation to choose settings on, evaluation for figures that are reported")
    ap.add_argument("--vllm", action="store_true", help="also vLLM CPU's perplexity on each W8A8 export (pydoc)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    console = Console(width=200)
    protocol = {"model": args.model, "dtype": args.dtype, "split": args.split, "samples": args.samples,
                "windows": args.windows, "corpora": args.corpora.split(",")}
    labels = ["float"] + [v for v in (args.only or VARIANTS) if v != "float"]
    rows, served = kept_rows(args.json, protocol, args.vllm) if args.json and args.json.exists() else ([], [])
    done = {r["variant"] for r in rows}
    source = load_checkpoint(args.model, dtype=args.dtype)
    sets = held_out_sets(source, protocol["corpora"], args.split, args.windows)
    with tempfile.TemporaryDirectory() as tmp:
        for label in labels:
            if label in done:
                console.print(f"{label}: kept from {args.json}")
                continue
            start = time.perf_counter()
            variant = copy.copy(source)
            variant.model = copy.deepcopy(source.model)
            compiled = compile_loaded(variant, variant_config(label, args.samples, args.dtype), Path(tmp) / label)
            compile_s = time.perf_counter() - start
            model = load_artifact(compiled.path).model
            metrics = next((r.metrics for r in compiled.reports if r.name == "int8"), {})
            for corpus, (windows, reference) in sets.items():
                scores = compare_on_windows(source.model, model, windows, reference=reference,
                                            batch_size=4 if reference is not None else 1)
                rows.append({"variant": label, "corpus": corpus, "windows": len(windows), "ppl": scores["ppl_student"],
                             "kl": scores["kl"], "top1": scores["top1_agreement"],
                             "smoothing_strength": metrics.get("smoothing_strength"),
                             "mean_output_error": metrics.get("mean_output_error"), "compile_s": compile_s})
                console.print(f"{label} on {corpus}: ppl {scores['ppl_student']:.4f}, KL {scores['kl']:.5f}, "
                              f"top-1 {scores['top1_agreement']:.4f}")
            del model
            if args.vllm and served_by_vllm(label):
                region = corpus_split(source.tokenizer, "pydoc").region(args.split)
                windows = evaluation_windows(region, args.windows, 512)
                ours = next(r["ppl"] for r in rows if r["variant"] == label and r["corpus"] == "pydoc")
                theirs = vllm_perplexity(compiled.path, Path(tmp), windows)
                served.append({"variant": label, "qcompile_eval_ppl": ours, "vllm_ppl": theirs["ppl"],
                               "ratio": theirs["ppl"] / ours, "tokens": theirs["tokens"], "vllm_build": theirs["vllm_build"]})
                console.print(f"{label}: vLLM {theirs['ppl']:.4f} against qcompile eval {ours:.4f} "
                              f"({100 * (theirs['ppl'] / ours - 1):+.2f}%, vLLM build {theirs['vllm_build']})")
            if args.json:  # after each variant, so that a stopped run keeps what it measured
                write_result(args.json, rows, **protocol, vllm=served)
    console.print(results_table(rows, args))
    return result(rows, **protocol, vllm=served)


def kept_rows(path: Path, protocol: dict, with_vllm: bool) -> tuple[list[dict], list[dict]]:
    """The rows (and vLLM rows) of an earlier run of the same protocol, for each variant it finished:
    with ``with_vllm``, a served variant counts as finished once its vLLM row is there too."""
    doc = read_result(path)
    if any(doc.get(k) != v for k, v in protocol.items()):
        return [], []
    served = {r["variant"] for r in doc.get("vllm", [])}
    finished = {r["variant"] for r in doc["rows"]
                if not (with_vllm and served_by_vllm(r["variant"])) or r["variant"] in served}
    return [r for r in doc["rows"] if r["variant"] in finished], [r for r in doc.get("vllm", []) if r["variant"] in finished]


def served_by_vllm(label: str) -> bool:
    """Whether ``--vllm`` serves this variant's export (every W8A8 one)."""
    options = VARIANTS[label]
    return options is not None and options.get("activation_scheme") != "none"


def results_table(rows: list[dict], args) -> Table:
    table = Table(title=f"{args.model} ({args.dtype}), {args.split} split, windows × 512 tokens, "
                        f"calibration {args.samples} × 512 (pydoc)")
    for col in ("variant", "corpus", "windows", "perplexity", "Δ vs float", "KL vs float", "top-1", "α", "compile s"):
        table.add_column(col, justify="left" if col in ("variant", "corpus") else "right")
    base = {r["corpus"]: r["ppl"] for r in rows if r["variant"] == "float"}
    for r in rows:
        alpha = r["smoothing_strength"]
        table.add_row(r["variant"], r["corpus"], str(r["windows"]), f"{r['ppl']:.3f}",
                      f"{100 * (r['ppl'] / base[r['corpus']] - 1):+.2f}%", f"{r['kl']:.4f}", f"{100 * r['top1']:.1f}%",
                      "-" if alpha is None else f"{alpha}", f"{r['compile_s']:.0f}")
    return table


if __name__ == "__main__":
    main()
