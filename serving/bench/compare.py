"""Compare two results: per-metric ratios B/A with a noise band drawn from repeated trials.

The band of a metric at a load point is ``max(floor, k × CV)`` where CV is the larger relative
standard deviation of the per-trial values in A and B (``--repeat`` > 1 gives trials; one
trial gives CV 0, so the floor alone applies). A latency above ``1 + band`` or a throughput
below ``1 - band`` is a regression; the opposite is an improvement.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from serving.bench.errors import BenchError

# (metric, statistic, higher_is_better)
COMPARED = [("time_to_first_token", "p50", False), ("time_to_first_token", "p99", False),
            ("inter_token_latency", "p50", False), ("time_per_output_token", "mean", False),
            ("request_latency", "p50", False), ("request_latency", "p99", False),
            ("output_token_throughput", "mean", True), ("request_throughput", "mean", True)]


@dataclass(frozen=True)
class Comparison:
    label: str
    metric: str
    stat: str
    a: float
    b: float
    band: float
    verdict: str  # "regression", "improvement", "within noise"

    @property
    def ratio(self) -> float:
        return self.b / self.a if self.a else float("inf")


def _trial_cv(run: dict, metric: str) -> float:
    """Relative std of the metric's per-trial values (trial means for latencies)."""
    values = [t[metric] if metric in t else t["mean_ms"].get(metric) for t in run["trials"]]
    values = [v for v in values if v is not None]
    if len(values) < 2 or not statistics.fmean(values):
        return 0.0
    return statistics.pstdev(values) / abs(statistics.fmean(values))


def _key(run: dict) -> tuple:
    load = run["load"]
    return load["mode"], load["concurrency"], load["request_rate"]


def compare_results(a: dict, b: dict, floor: float = 0.05, k: float = 2.0) -> list[Comparison]:
    """Every compared metric at every load point present in both results."""
    runs_b = {_key(r): r for r in b["runs"]}
    out = []
    for run_a in a["runs"]:
        run_b = runs_b.get(_key(run_a))
        if run_b is None:
            continue
        for metric, stat, higher_better in COMPARED:
            va, vb = run_a["metrics"][metric].get(stat), run_b["metrics"][metric].get(stat)
            if va is None or vb is None:
                continue
            band = max(floor, k * max(_trial_cv(run_a, metric), _trial_cv(run_b, metric)))
            ratio = vb / va if va else float("inf")
            worse = ratio < 1 - band if higher_better else ratio > 1 + band
            better = ratio > 1 + band if higher_better else ratio < 1 - band
            verdict = "regression" if worse else "improvement" if better else "within noise"
            out.append(Comparison(run_a["label"], metric, stat, va, vb, band, verdict))
    if not out:
        raise BenchError("the two results share no load point (same mode, concurrency and request rate); nothing to compare")
    return out
