r"""AWQ vs round-to-nearest INT4 on SmolLM2-135M (or ``--model``): perplexity, quantization time, peak memory.

    python benchmarks/awq_quality.py                       # float, RTN and AWQ at g128-fallback, g64, g32
    python benchmarks/awq_quality.py --model gemma3-270m --groups 128,64   # the second real model
    python benchmarks/awq_quality.py --groups 64 --samples 128 --windows 16
    python benchmarks/awq_quality.py --groups 64 --methods awq --set duo_scaling=all   # any awq option
    python benchmarks/awq_quality.py --groups 128 --samples 32 --windows 15 --split validation \
        --calibration pydoc,pydoc+stdlib-docs --corpora pydoc,stdlib-docs   # calibration corpora, to choose on

Protocol: calibration ``--samples`` × 512 tokens (seed 0) of each of ``--calibration`` (default
pydoc; ``a+b`` mixes corpora; one AWQ row per corpus), perplexity on the first ``--windows``
512-token windows of the ``--split`` region (evaluation: reported figures; validation: choices)
of each of ``--corpora`` (``calib.protocol``). Each (method, group size) runs in its own
subprocess so its wall time, CPU time (user + system, all threads) and peak RSS are its own.
"AWQ share of RTN's increase" = (ppl_awq - ppl_float) / (ppl_rtn - ppl_float).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import write_result  # noqa: E402


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_one(model_name: str, method: str, group_size: int, samples: int, windows: int, options: dict,
            calibration: str = "pydoc", corpora: tuple[str, ...] = ("pydoc",), split: str = "evaluation") -> dict:
    """Load ``model_name`` (a built-in model, a checkpoint path), quantize it with ``method`` (float | rtn | awq), evaluate; one JSON row."""
    import torch

    from compiler.formats.int4 import Int4Linear
    from compiler.io.load import load_checkpoint
    from compiler.pipeline import PassContext, Pipeline, PipelineConfig
    from compiler.pipeline.evaluate import evaluate_perplexity
    from passes.awq_plan import AWQOptions, plan_layers

    loaded = load_checkpoint(model_name)
    model = loaded.model
    wall, cpu = time.perf_counter(), _cpu_s()
    if method == "rtn":  # same layers and group-size fallback as AWQ, no search
        plans, _ = plan_layers(model, AWQOptions(group_size=group_size))
        for name, plan in plans.items():
            model.set_submodule(name, Int4Linear.from_float(model.get_submodule(name), plan.group_size))
    elif method == "awq":
        config = PipelineConfig.from_dict({"calibration": {"corpus": calibration, "samples": samples, "seq_len": 512},
                                           "passes": [{"name": "awq", "group_size": group_size, **options}]})
        pipeline = Pipeline(config)
        pipeline.validate(model.config)
        context = PassContext(tokenizer=loaded.tokenizer, calibration=config.calibration)
        with torch.no_grad():
            pipeline.run(model, context)
    quant_wall, quant_cpu = time.perf_counter() - wall, _cpu_s() - cpu
    ppl = {corpus: evaluate_perplexity(loaded, corpus, windows, split=split)["ppl"] for corpus in corpora}
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"model": model_name, "method": method, "group_size": group_size, "ppl": ppl[corpora[0]],
            "ppl_by_corpus": ppl, "split": split, "calibration": calibration, "quant_wall_s": quant_wall,
            "quant_cpu_s": quant_cpu, "peak_rss_mib": peak_mib, "samples": samples, "windows": windows,
            "options": options}


def _child(args, method: str, group_size: int, calibration: str) -> dict:
    cmd = [sys.executable, __file__, "--model", args.model, "--one", f"{method}:{group_size}",
           "--samples", str(args.samples), "--windows", str(args.windows), "--calibration", calibration,
           "--corpora", args.corpora, "--split", args.split]
    cmd += [a for kv in args.set for a in ("--set", kv)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{method} g{group_size} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a built-in model (smollm2, gemma3-270m) or a checkpoint path")
    ap.add_argument("--groups", default="128,64,32", help="group sizes (128 falls back to 64 where it does not divide)")
    ap.add_argument("--methods", default="rtn,awq")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--calibration", default="pydoc",
                    help="the AWQ rows' calibration corpora, comma-separated ('a+b' mixes corpora)")
    ap.add_argument("--corpora", default="pydoc", help="the corpora perplexity is measured on, comma-separated")
    ap.add_argument("--split", default="evaluation", choices=("evaluation", "validation"))
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an awq pass option for the AWQ rows (VALUE as JSON, else a string)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        method, g = args.one.split(":")
        print(json.dumps(run_one(args.model, method, int(g), args.samples, args.windows, _options(args.set),
                                 args.calibration, tuple(args.corpora.split(",")), args.split)))
        return
    calibrations = args.calibration.split(",")
    jobs = [("float", 0, "pydoc")] + [(m, int(g), c) for g in args.groups.split(",") for m in args.methods.split(",")
                                      for c in (calibrations if m == "awq" else ["pydoc"])]
    rows = []
    for method, g, calibration in jobs:
        rows.append(_child(args, method, g, calibration))
        print(json.dumps(rows[-1]), flush=True)  # each row as soon as it exists
    print(markdown_table(rows))
    return write_result(args.json, rows, model=args.model, samples=args.samples, windows=args.windows, split=args.split)


def _options(sets: list[str]) -> dict:
    options = {}
    for kv in sets:
        key, _, value = kv.partition("=")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def markdown_table(rows: list[dict]) -> str:
    """One perplexity and AWQ-share column pair per corpus; share = (awq - float) / (rtn - float) at the group size."""
    corpora = list(rows[0]["ppl_by_corpus"])
    base = rows[0]["ppl_by_corpus"]
    rtn = {r["group_size"]: r["ppl_by_corpus"] for r in rows if r["method"] == "rtn"}
    header = "".join(f" {c} perplexity | {c} AWQ share of RTN's increase |" for c in corpora)
    lines = [f"| method | group size | calibration |{header} quantize wall s | quantize CPU s | peak RSS MiB |",
             "|---|---|---|" + "---|---|" * len(corpora) + "---|---|---|"]
    for r in rows:
        g = "-" if r["method"] == "float" else ("128 (64 where 128 does not divide)" if r["group_size"] == 128 else str(r["group_size"]))
        cells = ""
        for c in corpora:
            ppl, share = r["ppl_by_corpus"][c], ""
            if r["method"] == "awq" and r["group_size"] in rtn:
                share = f"{(ppl - base[c]) / (rtn[r['group_size']][c] - base[c]):.2f}"
            cells += f" {ppl:.3f} | {share} |"
        calibration = f"{r['samples']} × {r['calibration']}" if r["method"] == "awq" else ""
        lines.append(f"| {r['method']} | {g} | {calibration} |{cells} {r['quant_wall_s']:.1f} | {r['quant_cpu_s']:.1f} | "
                     f"{r['peak_rss_mib']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
