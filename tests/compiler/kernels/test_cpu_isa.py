"""The C++ CPU kernels' ISA levels (``compiler/kernels/cpu_isa.py``, ``cpu_build.py``, ``cpu_ext.py``):
which levels a CPU runs from its flags, the ``QCOMPILE_CPU_ISA`` cap, every level built on any host,
each level's library reporting its own level, and a process capped to AVX2 running the AVX2
kernels end to end through the serving engine, which says so."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compiler.errors import ConfigError
from compiler.kernels import cpu_build, cpu_ext, cpu_isa

ROOT = Path(__file__).resolve().parents[3]
# /proc/cpuinfo's flags of the three hosts this project runs on (the features that matter here).
ZEN3 = "fpu sse2 avx f16c fma bmi1 bmi2 movbe avx2"
ZEN4 = ZEN3 + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16"
SAPPHIRE_RAPIDS = ZEN4 + " avx_vnni amx_tile amx_int8 amx_bf16"
SKYLAKE_SP = ZEN3 + " avx512f avx512dq avx512cd avx512bw avx512vl"
SIERRA_FOREST = ZEN3 + " avx_vnni"  # E-cores: AVX-VNNI without AVX-512


@pytest.fixture
def cpu(monkeypatch):
    """Pretend the CPU has these /proc/cpuinfo flags (on x86-64)."""
    def set_flags(flags: str, machine: str = "x86_64"):
        monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset(flags.split()))
        monkeypatch.setattr(cpu_isa.platform, "machine", lambda: machine)
        cpu_isa.host_levels.cache_clear()

    yield set_flags
    monkeypatch.undo()
    cpu_isa.host_levels.cache_clear()


@pytest.mark.parametrize("flags, levels", [(ZEN3, ("avx2",)), (SIERRA_FOREST, ("avx2", "avx2_vnni")),
                                           (SKYLAKE_SP, ("avx2", "avx512")),
                                           (ZEN4, ("avx2", "avx512", "avx512_vnni", "avx512_bf16")),
                                           (SAPPHIRE_RAPIDS, cpu_isa.LEVEL_NAMES), ("fpu sse2 avx", ())])
def test_the_levels_a_cpu_runs_follow_its_flags(cpu, flags, levels):
    cpu(flags)
    assert cpu_isa.host_levels() == levels


def test_no_level_off_x86_and_the_reason_says_so(cpu):
    cpu(ZEN4, machine="aarch64")
    assert cpu_isa.host_levels() == () and cpu_isa.active_level() is None
    assert "aarch64" in cpu_isa.no_level_reason() and "x86-64-v3" in cpu_isa.no_level_reason()


def test_the_cap_lowers_the_level_and_never_raises_it(cpu, monkeypatch):
    cpu(ZEN4)
    monkeypatch.delenv(cpu_isa.CAP_SWITCH, raising=False)  # a capped run (scripts/test_isa_levels.sh) sets it
    assert cpu_isa.active_level() == "avx512_bf16"
    monkeypatch.setenv(cpu_isa.CAP_SWITCH, "avx512")
    assert cpu_isa.active_level() == "avx512" and cpu_isa.allowed_levels() == ("avx2", "avx512")
    monkeypatch.setenv(cpu_isa.CAP_SWITCH, "avx2_vnni")
    assert cpu_isa.active_level() == "avx2"  # Zen 4 has no AVX-VNNI: the level below it
    cpu(ZEN3)
    monkeypatch.setenv(cpu_isa.CAP_SWITCH, "avx512_bf16")
    assert cpu_isa.active_level() == "avx2"  # never above what the CPU has
    cpu(SIERRA_FOREST)
    assert cpu_isa.active_level() == "avx2_vnni"


def test_an_unknown_cap_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv(cpu_isa.CAP_SWITCH, "avx10")
    with pytest.raises(ConfigError, match=r"QCOMPILE_CPU_ISA='avx10' is not an ISA level; use one of avx2, avx2_vnni, avx512, "):
        cpu_isa.active_level()


def test_the_levels_command_lists_the_allowed_levels_or_says_what_is_wrong(monkeypatch, cpu, capsys):
    cpu(ZEN4)
    monkeypatch.setenv(cpu_isa.CAP_SWITCH, "avx512")
    assert cpu_isa.main() == 0 and capsys.readouterr().out == "avx2\navx512\n"
    monkeypatch.setenv(cpu_isa.CAP_SWITCH, "avx10")
    assert cpu_isa.main() == 2
    err = capsys.readouterr().err
    assert err.startswith("error: QCOMPILE_CPU_ISA='avx10' is not an ISA level") and err.count("\n") == 1


def test_a_level_the_cpu_does_not_run_is_never_loaded(cpu):
    cpu(ZEN3)
    ops, why = cpu_ext._load.__wrapped__("avx512")  # uncached: this process may have loaded it for real
    assert ops is None and why == "this CPU does not run avx512 (it runs: avx2)"


def test_every_level_is_built_whatever_the_host():
    assert cpu_ext.cpu_kernels() is not None, cpu_ext.cpu_kernels_status()
    for level in cpu_isa.LEVEL_NAMES:
        assert cpu_build.library_path(level).is_file(), f"{level} was not built"


def test_each_levels_library_reports_its_level(isa):
    assert cpu_ext.cpu_kernels().isa() == isa == cpu_ext.cpu_isa_in_use()
    assert cpu_ext.cpu_kernels_status() == f"loaded ({isa})"


# Run in a child process capped at AVX2: a tiny INT4 model served by the engine on W4A8.
CAPPED_ENGINE = r"""
import json, sys
from compiler.formats.int4 import Int4Linear
from compiler.io.load import load_checkpoint
from serving.engine import Engine
from compiler.deploy.serving_plan import ServingPlan
loaded = load_checkpoint(sys.argv[1])
for layer in loaded.model.layers:
    layer.mlp.down_proj = Int4Linear.from_float(layer.mlp.down_proj, 32)
engine = Engine(loaded.model, None, ServingPlan(int4_compute="w4a8"), "cpu")
print(json.dumps(engine.load_report.kernels))
"""


def test_a_process_capped_at_avx2_runs_the_avx2_kernels_and_says_so(tiny_checkpoint):
    """One build, loaded by a process capped below the CPU's level: it takes the AVX2 library, and the
    engine's report names that level beside every qcompile kernel (the float linears, W4A8, attention)."""
    if os.environ.get(cpu_ext.SWITCH) == "0" or "avx2" not in cpu_isa.host_levels():
        pytest.skip("needs qcompile's kernels on an x86-64-v3 CPU")
    path, _ = tiny_checkpoint("llama")
    env = {**os.environ, cpu_isa.CAP_SWITCH: "avx2", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", CAPPED_ENGINE, str(path)], capture_output=True, text=True, env=env,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    kernels = json.loads(run.stdout.splitlines()[-1])
    assert kernels["isa"] == "avx2" and kernels["cpu"] == "loaded (avx2)"
    assert kernels["linear"] == "dense_linear [avx2]" and kernels["attention"] == "cpu [avx2]"
    assert kernels["int4"]["decode"] == {"w4a8_linear [avx2]": 2} and kernels["int4"]["prefill"] == kernels["int4"]["decode"]
