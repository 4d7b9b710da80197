"""``qcompile bench TARGET`` (latency benchmark) and ``qcompile bench compare A.json B.json``."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from qcompile.cli.console import err, out
from qcompile.cli.options import emit, json_option, output_json_option, parse_list


class _BenchGroup(TyperGroup):
    """``bench TARGET …`` runs a benchmark; ``bench compare …`` compares. A first word that is not a
    subcommand is a TARGET, so it is routed to the hidden ``run`` command."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


app = typer.Typer(cls=_BenchGroup, no_args_is_help=True, add_completion=False,
                  help="Latency benchmark of a serving target: TTFT, ITL, TPOT, latency, throughput. "
                       "Run it as 'qcompile bench TARGET [OPTIONS]' (options: 'qcompile bench run --help').")


@app.command("run")
def run_cmd(
    target: str = typer.Argument(..., help="Artifact dir, triton-grpc://HOST:PORT/MODEL, triton-http://HOST:PORT/MODEL, "
                                         "openai://HOST:PORT or openai://HOST:PORT/MODEL (an OpenAI-compatible server: vLLM, llama.cpp, ...), "
                                         "ONNX dir or Ascend bundle."),
    concurrency: list[str] = typer.Option([], help="Closed-loop concurrency, or a comma list to sweep (default 1)."),
    request_rate: list[str] = typer.Option([], help="Open loop: Poisson arrivals per second, or a comma list to sweep."),
    num_requests: int = typer.Option(64, min=1, help="Measured requests per trial."),
    duration: Optional[float] = typer.Option(None, min=0.1, help="Measure for this many seconds instead of a request count."),
    warmup: int = typer.Option(2, min=0, help="Unmeasured warm-up requests before each trial."),
    repeat: int = typer.Option(1, min=1, help="Trials per load point (their spread is compare's noise band)."),
    prompt_len: str = typer.Option("128", help="Prompt tokens: N, uniform:LO:HI or normal:MEAN:STD."),
    output_len: str = typer.Option("64", help="Output tokens (EOS ignored): N, uniform:LO:HI or normal:MEAN:STD."),
    prompts: Optional[Path] = typer.Option(None, help="A .jsonl prompts file ({\"prompt\": ..., \"output_len\": ...} per line)."),
    shared_prefix: int = typer.Option(0, min=0, help="Tokens of a prefix shared by every prompt (prefix caching)."),
    corpus: str = typer.Option("pydoc", help="Corpus the synthetic prompts are cut from."),
    tokenizer: Optional[Path] = typer.Option(None, help="Tokenizer directory (needed for server targets)."),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="triton-http: --no-stream uses /generate (one response; TTFT = latency)."),
    goodput: list[str] = typer.Option([], help="SLOs in ms, a comma list: time_to_first_token:200,request_latency:2000."),
    seed: int = typer.Option(0, help="Seed of the workload and the arrivals."),
    int4_compute: Optional[str] = typer.Option(None, help="Artifact targets: how INT4 layers compute, auto (w4a8 on a "
                                                         "CPU that runs it), w4a16 (the format) or w4a8 (int8 activations, faster on "
                                                         "the CPU); default: the artifact's plan."),
    as_json: bool = json_option(),
    output_json: Optional[Path] = output_json_option(),
    output_csv: Optional[Path] = typer.Option(None, help="Write one CSV row per load point here."),
    output_md: Optional[Path] = typer.Option(None, help="Write a markdown summary here."),
    plots: Optional[Path] = typer.Option(None, help="Write PNG plots into this directory."),
):
    """Benchmark TARGET (also spelled 'qcompile bench TARGET'): closed loop at --concurrency or open loop at --request-rate."""
    from serving.bench.benchmark import load_points, run_benchmark
    from serving.bench.metrics import parse_slos
    from serving.bench.output import json_safe
    from serving.bench.workload import LengthDist, WorkloadConfig

    workload = WorkloadConfig(LengthDist.parse(prompt_len, "--prompt-len"), LengthDist.parse(output_len, "--output-len"),
                              corpus, prompts, shared_prefix, seed)
    loads = load_points(parse_list(concurrency, int, "--concurrency"), parse_list(request_rate, float, "--request-rate"),
                        num_requests, duration, warmup, seed)
    result = run_benchmark(target, workload, loads, repeat, parse_slos(",".join(goodput)), tokenizer, stream,
                           {"int4_compute": int4_compute} if int4_compute else None)
    notes = err if as_json else out
    emit(json_safe(result), as_json, output_json, lambda: print_result(result))
    if result["interrupted"]:
        notes.print("[yellow]interrupted[/yellow]: the results hold the requests that finished before Ctrl-C")
    _write_reports(result, output_csv, output_md, plots, notes)


def _write_reports(result: dict, output_csv, output_md, plots, console: Console) -> None:
    from compiler.io.atomic import atomic_write_text
    from serving.bench.output import csv_text, markdown_summary, write_plots

    for path, text in ((output_csv, csv_text), (output_md, markdown_summary)):
        if path is not None:
            atomic_write_text(path, text(result))
            console.print(f"wrote {path}")
    if plots is not None:
        for path in write_plots(result, plots):
            console.print(f"wrote {path}")


def print_result(result: dict, console: Console = out) -> None:
    """One table row per load point (ms unless stated)."""
    table = Table(title=f"{result['target']} ({result['adapter']})")
    for col in ("load", "ok/total", "len mismatch", "TTFT p50", "TTFT p99", "ITL p50", "TPOT mean", "latency p50",
                "latency p99", "out tok/s", "req/s", *(["goodput"] if result["slos_ms"] else [])):
        table.add_column(col, justify="left" if col == "load" else "right")
    for run in result["runs"]:
        m, c = run["metrics"], run["metrics"]["counts"]
        cells = [run["label"], f"{c['successful']}/{c['requests']}", str(c["output_length_mismatch"]),
                 *(f"{m[k][s]:.1f}" for k, s in (("time_to_first_token", "p50"), ("time_to_first_token", "p99"))),
                 f"{m['inter_token_latency']['p50']:.2f}", f"{m['time_per_output_token']['mean']:.2f}",
                 f"{m['request_latency']['p50']:.1f}", f"{m['request_latency']['p99']:.1f}",
                 f"{m['output_token_throughput']['mean']:.1f}", f"{m['request_throughput']['mean']:.3f}"]
        if result["slos_ms"]:
            cells.append(f"{m['goodput']['mean']:.3f}")
        table.add_row(*cells)
    console.print(table)
    if kernels := result["workload"].get("engine_kernels"):
        from serving.engine_setup import describe_kernels

        console.print(f"kernels: {describe_kernels(kernels)}", markup=False, highlight=False)


def bench_stage(console: Console, artifact: str) -> dict:
    """The main job's latency stage: an artifact on the in-process engine at concurrency 1 and 4 (kept small)."""
    from serving.bench.benchmark import load_points, run_benchmark
    from serving.bench.workload import LengthDist, WorkloadConfig

    console.print("latency ([bold]qcompile bench[/bold], in-process engine, 32-token prompts, 8 output tokens) …")
    workload = WorkloadConfig(LengthDist("fixed", 32), LengthDist("fixed", 8))
    result = run_benchmark(artifact, workload, load_points([1, 4], num_requests=4, warmup=1))
    print_result(result, console)
    return result


@app.command("compare")
def compare_cmd(
    baseline: Path = typer.Argument(..., help="Result JSON A (the baseline)."),
    candidate: Path = typer.Argument(..., help="Result JSON B."),
    noise: float = typer.Option(0.05, min=0.0, help="Smallest noise band (relative); widened to 2× the trials' spread."),
    fail_on_regression: bool = typer.Option(False, "--fail-on-regression", help="Exit 3 when a metric regressed."),
):
    """Per-metric ratios B/A at each shared load point; flags changes beyond the noise band."""
    from serving.bench.compare import compare_results
    from serving.bench.errors import RegressionError
    from serving.bench.output import read_result

    rows = compare_results(read_result(baseline), read_result(candidate), floor=noise)
    table = Table(title=f"{candidate} vs {baseline}")
    for col in ("load", "metric", "A", "B", "B/A", "band", "verdict"):
        table.add_column(col, justify="right" if col in ("A", "B", "B/A", "band") else "left")
    style = {"regression": "red", "improvement": "green", "within noise": ""}
    for r in rows:
        table.add_row(r.label, f"{r.metric} {r.stat}", f"{r.a:.3f}", f"{r.b:.3f}", f"{r.ratio:.3f}", f"±{100 * r.band:.1f}%",
                      f"[{style[r.verdict]}]{r.verdict}[/]" if style[r.verdict] else r.verdict)
    out.print(table)
    regressions = [r for r in rows if r.verdict == "regression"]
    if regressions and fail_on_regression:
        worst = max(regressions, key=lambda r: abs(r.ratio - 1))
        raise RegressionError(f"{len(regressions)} metric(s) regressed beyond the noise band; worst: {worst.label} "
                              f"{worst.metric} {worst.stat} ×{worst.ratio:.3f} (band ±{100 * worst.band:.1f}%)")
