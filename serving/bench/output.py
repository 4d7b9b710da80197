"""Writing a result: JSON, CSV, a markdown summary and PNG plots; reading a result back."""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import numpy as np

from serving.bench.errors import BenchError
from serving.bench.metrics import LATENCY_METRICS
from serving.bench.suite import SCHEMA, SCHEMA_VERSION

STATS = ("mean", "std", "p50", "p90", "p95", "p99")
RATE_METRICS = ("output_token_throughput", "request_throughput", "goodput")


def json_safe(value):
    """JSON has no NaN: empty statistics are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def read_result(path: Path) -> dict:
    """A result JSON written by ``qcompile bench``; an error for anything else or another schema version."""
    try:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchError(f"{path} not found; write one with 'qcompile bench TARGET --output-json {path}'") from None
    except json.JSONDecodeError as e:
        raise BenchError(f"{path} is not JSON ({e.msg})") from None
    if not isinstance(result, dict) or result.get("schema") != SCHEMA:
        raise BenchError(f"{path} is not a qcompile bench result")
    if result.get("schema_version") != SCHEMA_VERSION:
        raise BenchError(f"{path} has schema version {result.get('schema_version')}, this qcompile reads {SCHEMA_VERSION}; rerun the benchmark")
    return result


def csv_text(result: dict) -> str:
    """One row per load point: its settings, then METRIC_STAT columns."""
    columns = ["label", "mode", "concurrency", "request_rate", "requests", "successful", "failed"]
    metric_names = [*LATENCY_METRICS, *(m for m in RATE_METRICS if any(m in r["metrics"] for r in result["runs"]))]
    columns += [f"{m}_{s}" for m in metric_names for s in STATS]
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(columns)
    for run in result["runs"]:
        m, load, counts = run["metrics"], run["load"], run["metrics"]["counts"]
        row = [run["label"], load["mode"], load["concurrency"], load["request_rate"], counts["requests"],
               counts["successful"], counts["failed"]]
        row += [m.get(name, {}).get(s) for name in metric_names for s in STATS]
        writer.writerow(row)
    return buf.getvalue()


def _fmt(value, digits: int = 1) -> str:
    return "–" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.{digits}f}"


def markdown_summary(result: dict) -> str:
    """A short markdown table: one row per load point (latencies in ms)."""
    env = result["environment"]
    kernels = result["workload"].get("engine_kernels")
    if kernels:
        from serving.engine_setup import describe_kernels  # the engine's report: torch is loaded already
    lines = [f"# qcompile bench: {result['target']} ({result['adapter']})", "",
             f"{result['created']} · {env['hardware']['cpu']} × {env['hardware']['cpu_count']} · "
             f"commit {str(env['git']['commit'])[:10]} · workload {result['workload']['kind']} "
             f"prompt {result['workload']['prompt_len']} output {result['workload']['output_len']}"
             + (" · **interrupted**" if result["interrupted"] else ""), "",
             *([f"kernels: {describe_kernels(kernels)}", ""] if kernels else []),
             "| load | ok/total | TTFT p50 | TTFT p99 | ITL p50 | TPOT mean | latency p50 | latency p99 | out tok/s | req/s |"
             + (" goodput |" if result["slos_ms"] else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if result["slos_ms"] else "")]
    for run in result["runs"]:
        m, c = run["metrics"], run["metrics"]["counts"]
        row = (f"| {run['label']} | {c['successful']}/{c['requests']} | {_fmt(m['time_to_first_token']['p50'])} | "
               f"{_fmt(m['time_to_first_token']['p99'])} | {_fmt(m['inter_token_latency']['p50'], 2)} | "
               f"{_fmt(m['time_per_output_token']['mean'], 2)} | {_fmt(m['request_latency']['p50'])} | "
               f"{_fmt(m['request_latency']['p99'])} | {_fmt(m['output_token_throughput']['mean'])} | "
               f"{_fmt(m['request_throughput']['mean'], 3)} |")
        if result["slos_ms"]:
            row += f" {_fmt(m['goodput']['mean'], 3)} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def write_plots(result: dict, out_dir: Path) -> list[Path]:
    """latency_vs_throughput.png (over the sweep), ttft_distribution.png, itl_distribution.png."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    runs = result["runs"]
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["metrics"]["output_token_throughput"]["mean"] for r in runs]
    for metric, label in (("request_latency", "request latency"), ("time_to_first_token", "TTFT")):
        for stat in ("p50", "p99"):
            ax.plot(x, [r["metrics"][metric][stat] for r in runs], marker="o", label=f"{label} {stat}")
    for xi, r in zip(x, runs):
        ax.annotate(r["label"], (xi, r["metrics"]["request_latency"]["p50"]), fontsize=7)
    ax.set(xlabel="output tokens/s", ylabel="ms", title=f"latency vs throughput: {result['adapter']}")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir / "latency_vs_throughput.png"))
    for key, name, fname in (("ttft", "time to first token", "ttft_distribution.png"),
                             ("itl", "inter-token latency", "itl_distribution.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        samples = [_samples(r, key) for r in runs]
        pooled = [x for s in samples for x in s]
        bins = np.histogram_bin_edges(pooled, bins=40) if pooled else 40  # one set of bins so the runs compare
        for r, values in zip(runs, samples):
            ax.hist(values, bins=bins, alpha=0.5, label=r["label"])
        ax.set(xlabel="ms", ylabel="count", title=name)
        ax.legend(fontsize=7)
        paths.append(_save(fig, out_dir / fname))
    return paths


def _samples(run: dict, key: str) -> list[float]:
    ok = [q for q in run["requests"] if q["error"] is None and q["finish_reason"] not in ("abort", "error")]
    if key == "ttft":
        return [q["time_to_first_token_ms"] for q in ok if q["time_to_first_token_ms"] is not None]
    return [b - a for q in ok for a, b in zip(q["chunk_offsets_ms"], q["chunk_offsets_ms"][1:])]


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

