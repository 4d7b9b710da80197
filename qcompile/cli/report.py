"""Tables for pass reports and artifact summaries (``qcompile compile`` / ``inspect``), and the KL-divergence
statistics of ``qcompile eval --reference`` (one runtime, or a row per runtime with ``--runtimes``)."""
from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.table import Table
from rich.text import Text


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


def print_summary(console: Console, s: dict) -> None:
    console.print(f"[bold]{s['path']}[/bold]  (source: {s['source']['path']}, sha256 {s['source']['sha256'][:12]}…)")
    print_reports(console, s["passes"])
    table = Table(title="layers")
    for col in ("module", "format", "group", "bits/weight", "MiB"):
        table.add_column(col, justify="right" if col != "module" else "left")
    for layer in s["layers"]:
        table.add_row(layer["module"], layer["format"], _fmt(layer.get("group_size", layer.get("block_type", ""))),
                      f"{layer['bits_per_weight']:.2f}", f"{layer['bytes'] / 2**20:.2f}")
    console.print(table)
    print_sensitive(console, s.get("sensitive", []))
    size = s["size"]
    formats = ", ".join(f"{k}: {v}" for k, v in s["formats"].items())
    console.print(f"formats: {formats}")
    cpu_kernels = Counter(layer["cpu_kernel"] for layer in s["layers"] if "cpu_kernel" in layer)
    for how, n in sorted(cpu_kernels.items()):
        console.print(f"INT4 on this CPU: {n} layers run {how}", markup=False)  # "[avx2]" is no markup
    console.print(f"qcompile's CPU kernels here: {s['cpu_isa'] or 'none'}")
    console.print(f"size on disk: weights {size['weights_bytes'] / 2**20:.1f} MiB, artifact {size['total_bytes'] / 2**20:.1f} MiB; "
                  f"source checkpoint {size['source_bytes'] / 2**20:.1f} MiB")


def print_sensitive(console: Console, rows: list[dict]) -> None:
    """The layers whose quantization costs most (``compiler.io.summary.most_sensitive``), if any was measured."""
    if not rows:
        return
    by_kl = rows[0]["kl_alone"] is not None
    table = Table(title=f"most sensitive layers (by {'KL of the layer alone' if by_kl else 'output error'})")
    for col in ("module", "format", "pass", "output error", "KL alone"):
        table.add_column(col, justify="left" if col in ("module", "format", "pass") else "right")
    for r in rows:
        table.add_row(r["module"], r["format"], r["pass"], f"{r['output_error']:.4f}",
                      "" if r["kl_alone"] is None else f"{r['kl_alone']:.2e}")
    console.print(table)


# (label, key, how to show it) in llama.cpp's order and wording (``llama-perplexity --kl-divergence``).
KL_ROWS = (
    ("Mean PPL(Q)", "ppl", "plain"),
    ("Mean PPL(base)", "ppl_base", "plain"),
    ("Cor(ln(PPL(Q)), ln(PPL(base)))", "ln_ppl_correlation", "percent"),
    ("Mean ln(PPL(Q)/PPL(base))", "ln_ppl_ratio", "plain"),
    ("Mean PPL(Q)/PPL(base)", "ppl_ratio", "plain"),
    ("Mean PPL(Q)-PPL(base)", "ppl_diff", "plain"),
    ("Mean KLD", "kld_mean", "plain"),
    ("Maximum KLD", "kld_max", "plain"),
    ("99.9% KLD", "kld_99_9", "plain"),
    ("99.0% KLD", "kld_99", "plain"),
    ("95.0% KLD", "kld_95", "plain"),
    ("90.0% KLD", "kld_90", "plain"),
    ("Median KLD", "kld_median", "plain"),
    ("Minimum KLD", "kld_min", "plain"),
    ("Mean Δp", "dp_mean", "percent"),
    ("RMS Δp", "rms_dp", "percent"),
    ("Same top p", "same_top", "percent"),
)


def print_kl_divergence(console: Console, result: dict) -> None:
    console.print(f"{_against(result)}: {result['tokens']} tokens of "
                  f"{result['corpus']}, {result['split']} region, {result['windows']} windows", markup=False)
    table = Table()
    for col in ("statistic", "value", "±"):
        table.add_column(col, justify="left" if col == "statistic" else "right")
    for label, key, how in KL_ROWS:
        value, uncertainty = result[key], result.get(f"{key}_uncertainty")
        if value is None:  # the correlation, undefined for a handful of tokens
            continue
        table.add_row(label, _statistic(value, how), "" if uncertainty is None else _statistic(uncertainty, how))
    console.print(table)


def _against(result: dict) -> str:
    """"KL divergence against REF", with the model a saved reference file came from."""
    saved_from = f" (saved from {result['reference_model']})" if result["reference_model"] != result["reference"] else ""
    return f"KL divergence against {result['reference']}{saved_from}"


def _statistic(value: float, how: str) -> str:
    return f"{100 * value:.3f} %" if how == "percent" else f"{value:.6f}"


# The columns of the one-row-per-runtime table (``qcompile eval --runtimes``): KL_ROWS' rows of these keys.
RUNTIME_COLUMNS = tuple(row for key in ("kld_mean", "kld_99", "same_top", "ppl", "ln_ppl_ratio", "rms_dp")
                        for row in KL_ROWS if row[1] == key)


def print_runtime_kl_divergence(console: Console, result: dict) -> None:
    """One row per runtime (value ± its uncertainty), what each KLD sums over, then what ran each row."""
    scored = [r for r in result["runtimes"] if "unavailable" not in r]
    base = f", Mean PPL(base) {scored[0]['ppl_base']:.6f}" if scored else ""
    console.print(f"{_against(result)}: {result['corpus']}, {result['split']} "
                  f"region, {result['windows']} windows{base}", markup=False)
    table = Table()
    table.add_column("runtime", justify="left")
    for label, _, _ in RUNTIME_COLUMNS:
        table.add_column(label, justify="right")
    table.add_column("KL over", justify="left")
    for row in result["runtimes"]:
        if "unavailable" in row:
            table.add_row(Text(row["runtime"]), *[""] * len(RUNTIME_COLUMNS), Text(f"not run: {row['unavailable']}"))
            continue
        cells = []
        for _, key, how in RUNTIME_COLUMNS:
            uncertainty = row.get(f"{key}_uncertainty")
            cells.append(_statistic(row[key], how) + ("" if uncertainty is None else f" ± {_statistic(uncertainty, how)}"))
        table.add_row(Text(row["runtime"]), *cells, Text(row["kl_over"]))  # Text: no markup read in messages
    console.print(table)
    for row in result["runtimes"]:
        if row.get("runs"):
            console.print(f"{row['runtime']}: {row['runs']}", markup=False)
