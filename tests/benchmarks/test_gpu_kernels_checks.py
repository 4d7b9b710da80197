"""benchmarks/gpu_kernels.py fails (non-zero exit, each check named) when a correctness figure is out
of its bound, instead of only recording it; the recorded H200 run is within every bound."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_kernels():
    spec = importlib.util.spec_from_file_location("gpu_kernels", ROOT / "benchmarks" / "gpu_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recorded_h200_run_is_within_bounds(gpu_kernels):
    recorded = json.loads((ROOT / "docs" / "data" / "gpu_kernels_h200.json").read_text())
    assert gpu_kernels.out_of_bounds(recorded, "cuda") == []


def test_each_kind_of_check_fails_by_name(gpu_kernels):
    recorded = json.loads((ROOT / "docs" / "data" / "gpu_kernels_h200.json").read_text())
    recorded["fp8_correctness"][0]["triton"] = 0.02
    recorded["fp8_correctness"][1]["cast_codes_equal_cpu"] = False
    recorded["w4a16_correctness"][1]["rel"] = float("nan")
    recorded["model_correctness"][0]["rel_gpu_vs_cpu"] = 0.5
    recorded["model_correctness"][1]["rel_gpu_vs_cpu"] = 0.02  # int4
    failed = gpu_kernels.out_of_bounds(recorded, "cuda")
    assert len(failed) == 5
    assert "triton = 0.02 (bound 0.01)" in failed[0] and "cast_codes_equal_cpu = False" in failed[1]
    assert "rel = nan" in failed[2] and "'format': 'fp8'" in failed[3] and "'format': 'int4'" in failed[4]
    recorded["model_correctness"] = "RuntimeError: boom"  # a part that raised
    assert gpu_kernels.out_of_bounds(recorded, "cuda")[-1] == "model_correctness: did not run (RuntimeError: boom)"


def test_smoke_run_exits_non_zero_on_a_failed_check(gpu_kernels, monkeypatch, tmp_path, capsys):
    """The dry run (Triton's interpreter here, small shapes on a GPU host) with the W4A16 bounds
    tightened below what it measures."""
    for bounds in gpu_kernels.BOUNDS.values():
        tight = {k: 1e-12 if k.startswith("torch.") else v for k, v in bounds["w4a16_correctness"].items()}
        monkeypatch.setitem(bounds, "w4a16_correctness", tight)
    monkeypatch.setattr(sys, "argv", ["gpu_kernels.py", "--smoke", "--json", str(tmp_path / "out.json")])
    with pytest.raises(SystemExit) as e:
        gpu_kernels.main()
    assert "correctness check(s) out of bound" in str(e.value)
    assert "FAILED w4a16_correctness" in capsys.readouterr().err
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["failed_checks"] and all("w4a16_correctness" in f for f in written["failed_checks"])
