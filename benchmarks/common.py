"""What every script in benchmarks/ shares: one way to time, one statistic, one result file.

Timing: ``measure(fn, repeats)`` calls ``fn`` ``warmup`` times untimed, then times ``repeats`` samples
(each ``calls`` calls, seconds per call) on one or more clocks (``CLOCKS``). A timing's figure is the
median of its samples, with the 90th percentile beside it: ``serving.bench.metrics.summarize``, the
statistics of ``qcompile bench`` (numpy's linear interpolation). Where a loop cannot be wrapped in one
function (interleaved runtimes, a decode loop), ``Timing.add`` takes each sample as it is measured.

Results: ``write_result(path, rows, **fields)`` writes one JSON document, schema ``qcompile.benchmark``:
the script, its command line, the date, the host (CPU model, ISA levels, qcompile's level in use,
load average), the git commit, the script's own ``fields`` and its ``rows`` (one dict per table row).

What measures serving (TTFT, ITL, tokens/s of requests) goes through ``qcompile bench``
(``serving.bench.benchmark.run_benchmark``) instead; its result schema is ``qcompile.bench``.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SCHEMA, SCHEMA_VERSION = "qcompile.benchmark", 1
# thread: this thread's CPU time (at one thread, what other processes' load barely moves); process: all threads'
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time, "process": time.process_time}


@dataclass
class Timing:
    """Seconds per call of each timed sample, per clock."""

    samples: dict[str, list[float]] = field(default_factory=dict)

    def add(self, **seconds: float) -> None:
        for clock, value in seconds.items():
            self.samples.setdefault(clock, []).append(value)

    def stats(self, clock: str = "wall") -> dict:
        """mean, std, min, max, p50, p90, p95, p99 and count, in ms."""
        from serving.bench.metrics import summarize

        return summarize([1e3 * s for s in self.samples[clock]], "ms")

    def median_ms(self, clock: str = "wall") -> float:
        return self.stats(clock)["p50"]

    def p90_ms(self, clock: str = "wall") -> float:
        return self.stats(clock)["p90"]


def time_call(fn, clocks=("wall",)):
    """``fn()``'s result and the seconds it took on each clock."""
    starts = {c: CLOCKS[c]() for c in clocks}
    out = fn()
    return out, {c: CLOCKS[c]() - starts[c] for c in clocks}


def measure(fn, repeats: int, *, warmup: int = 1, calls: int = 1, clocks=("wall",)) -> Timing:
    """``fn`` called ``warmup`` times untimed, then ``repeats`` samples of ``calls`` calls each."""
    for _ in range(warmup):
        fn()
    timing = Timing()

    def sample():
        for _ in range(calls):
            fn()

    for _ in range(repeats):
        _, seconds = time_call(sample, clocks)
        timing.add(**{c: s / calls for c, s in seconds.items()})
    return timing


def host() -> dict:
    """The machine a result was measured on: CPU model, its ISA levels, the level qcompile's kernels take."""
    from compiler.kernels.cpu_isa import active_level, host_levels
    from serving.bench.environment import cpu_model

    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "isa_levels": list(host_levels()),
            "isa_in_use": active_level(), "torch_threads": _torch_threads(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def _torch_threads() -> int | None:
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def result(rows: list[dict], **fields) -> dict:
    """The result document of a run: what ran, where, at which commit, and its rows."""
    from serving.bench.environment import git_commit

    script = Path(sys.argv[0]).resolve()
    name = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else script.name
    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "script": name,
            "command": " ".join(["python", name, *sys.argv[1:]]),
            "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "host": host(), "git": git_commit(), **fields, "rows": rows}


def write_result(path: Path | None, rows: list[dict], **fields) -> dict:
    """``result(rows, **fields)``, written to ``path`` (when given) as JSON; returned either way."""
    doc = result(rows, **fields)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return doc


def read_result(path: Path) -> dict:
    """A result file written by ``write_result``; refuses any other JSON."""
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a {SCHEMA} result (schema {doc.get('schema')!r})")
    return doc
