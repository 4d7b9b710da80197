"""benchmarks/common.py: the one timing statistic (median and p90 of the samples after the warm-up) and the
one result format; and every script in benchmarks/ has a smoke test here."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from bench_doubles import VirtualClock
from bench_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def common():
    return load_script("common")


def test_median_and_p90_of_the_samples_after_the_warm_up(common, monkeypatch):
    clock = VirtualClock()
    durations = iter([5.0, 0.010, 0.030, 0.020, 0.040, 0.050])  # the first call is the warm-up

    def fn():
        clock.advance(next(durations))

    monkeypatch.setitem(common.CLOCKS, "wall", clock)
    timing = common.measure(fn, 5)
    assert timing.samples["wall"] == pytest.approx([0.010, 0.030, 0.020, 0.040, 0.050])
    assert timing.median_ms() == pytest.approx(30.0) and timing.p90_ms() == pytest.approx(46.0)  # numpy's linear p90
    stats = timing.stats()
    assert (stats["count"], stats["min"], stats["max"], stats["unit"]) == (5, pytest.approx(10.0), pytest.approx(50.0), "ms")


def test_calls_per_sample_and_two_clocks(common, monkeypatch):
    wall, cpu = VirtualClock(), VirtualClock()

    def fn():
        wall.advance(0.004)
        cpu.advance(0.001)

    monkeypatch.setitem(common.CLOCKS, "wall", wall)
    monkeypatch.setitem(common.CLOCKS, "thread", cpu)
    timing = common.measure(fn, 3, warmup=0, calls=4, clocks=("wall", "thread"))
    assert timing.median_ms("wall") == pytest.approx(4.0) and timing.median_ms("thread") == pytest.approx(1.0)
    assert len(timing.samples["wall"]) == 3


def test_a_non_finite_sample_is_an_error(common):
    timing = common.Timing()
    timing.add(wall=float("nan"))
    with pytest.raises(Exception, match="not finite"):
        timing.median_ms()


def test_the_result_names_the_run(common, monkeypatch, tmp_path):
    monkeypatch.setattr("sys.argv", [str(ROOT / "benchmarks" / "dense_cpu.py"), "--rows", "1"])
    doc = common.write_result(tmp_path / "sub" / "r.json", [{"rows": 1, "ms": 2.0}], threads=2)
    assert json.loads((tmp_path / "sub" / "r.json").read_text()) == doc == common.read_result(tmp_path / "sub" / "r.json")
    assert (doc["schema"], doc["schema_version"], doc["script"]) == ("qcompile.benchmark", 1, "benchmarks/dense_cpu.py")
    assert doc["command"] == "python benchmarks/dense_cpu.py --rows 1"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["created"])
    assert set(doc["host"]) >= {"cpu", "isa_levels", "isa_in_use", "load_average"} and "commit" in doc["git"]
    assert doc["threads"] == 2 and doc["rows"] == [{"rows": 1, "ms": 2.0}]
    (tmp_path / "other.json").write_text(json.dumps({"schema": "qcompile.bench"}))
    with pytest.raises(ValueError, match="not a qcompile.benchmark result"):
        common.read_result(tmp_path / "other.json")


def test_every_script_has_a_smoke_test():
    """Each script in benchmarks/ is loaded or run by a test here (run_script/load_script by name, or its path)."""
    tests = "\n".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    named = set(re.findall(r"(?:run_script|load_script)\(\s*\"(\w+)\"", tests))
    named |= set(re.findall(r"\"benchmarks\"\s*/\s*\"(\w+)\.py\"", tests))
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    assert scripts - named == set(), f"scripts no test in tests/benchmarks/ runs: {sorted(scripts - named)}"
