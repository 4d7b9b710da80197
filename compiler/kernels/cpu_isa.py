"""The x86 instruction-set levels qcompile's C++ CPU kernels are built for, and the one this CPU runs.

Every level is built on every host (``compiler/kernels/cpu_build.py``: one library per level, each
with its own compiler flags, never ``-march=native``), and a process loads the best level its CPU
runs, at or below ``QCOMPILE_CPU_ISA`` when that is set. So one build (a wheel, a container image)
serves every x86-64-v3 server CPU, and a host can test each level up to its own::

    QCOMPILE_CPU_ISA=avx2 qcompile bench out/awq     # the AVX2 kernels, on an AVX-512 CPU too

The levels, lowest first (``csrc/isa.h`` has what each kernel family does with them):

    avx2         x86-64-v3: AVX2, FMA, F16C, BMI2, MOVBE (Intel Haswell, AMD Zen and later)
    avx2_vnni    avx2 and AVX-VNNI, 256-bit int8 dot products (Intel Alder Lake, Sierra Forest,
                 Sapphire Rapids; AMD Zen 5)
    avx512       x86-64-v4: AVX-512 F/BW/CD/DQ/VL (Intel Skylake-SP)
    avx512_vnni  avx512 and AVX512-VNNI (Intel Cascade Lake, Ice Lake)
    avx512_bf16  avx512_vnni and AVX512-BF16 (Intel Cooper Lake, Sapphire Rapids; AMD Zen 4)

A CPU runs the levels whose features it has (an AVX-512 CPU need not have AVX-VNNI: AMD Zen 4 has
not), and the cap keeps the levels at or below it in this order.

Below x86-64-v3, and on other architectures, there are no kernels: the callers run the torch
reference and say so (``cpu_ext.cpu_kernels_status()``).
"""
from __future__ import annotations

import functools
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from compiler.errors import ConfigError

CAP_SWITCH = "QCOMPILE_CPU_ISA"


@dataclass(frozen=True)
class IsaLevel:
    name: str
    cpu_flags: tuple[str, ...]  # what /proc/cpuinfo must list, this level's and every level's below
    cflags: tuple[str, ...]  # what the compiler builds this level's library with


_V3 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
LEVELS = (
    IsaLevel("avx2", _V3, ("-march=x86-64-v3",)),
    IsaLevel("avx2_vnni", _V3 + ("avx_vnni",), ("-march=x86-64-v3", "-mavxvnni")),
    IsaLevel("avx512", _V4, ("-march=x86-64-v4",)),
    IsaLevel("avx512_vnni", _V4 + ("avx512_vnni",), ("-march=x86-64-v4", "-mavx512vnni")),
    IsaLevel("avx512_bf16", _V4 + ("avx512_vnni", "avx512_bf16"), ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16")),
)
LEVEL_NAMES = tuple(level.name for level in LEVELS)


@functools.cache
def cpuinfo_field(name: str) -> str | None:
    """A field of the first CPU in /proc/cpuinfo (``flags``, ``vendor_id``, ``model name``); None where it says nothing."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty where /proc/cpuinfo says nothing)."""
    return frozenset((cpuinfo_field("flags") or "").split())


@functools.cache
def host_levels() -> tuple[str, ...]:
    """The levels this CPU runs, lowest first (none off x86-64)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    flags = cpu_flags()
    return tuple(level.name for level in LEVELS if flags.issuperset(level.cpu_flags))


def isa_cap() -> str | None:
    """``QCOMPILE_CPU_ISA``: the highest level a process may take, or None when unset."""
    cap = os.environ.get(CAP_SWITCH, "").strip().lower()
    if not cap:
        return None
    if cap not in LEVEL_NAMES:
        raise ConfigError(f"{CAP_SWITCH}={cap!r} is not an ISA level; use one of {', '.join(LEVEL_NAMES)}")
    return cap


def allowed_levels() -> tuple[str, ...]:
    """The levels this CPU runs at or below the cap, lowest first: what a process may load."""
    cap = isa_cap()
    allowed = LEVEL_NAMES[: LEVEL_NAMES.index(cap) + 1] if cap else LEVEL_NAMES
    return tuple(name for name in host_levels() if name in allowed)


def active_level() -> str | None:
    """The best level this CPU runs at or below the cap; None where it runs none."""
    levels = allowed_levels()
    return levels[-1] if levels else None


def no_level_reason() -> str:
    """Why ``active_level()`` is None (the cap cannot be: avx2 is the lowest level)."""
    return (f"this CPU ({platform.machine()}) is below x86-64-v3 (AVX2, FMA, F16C), the lowest level qcompile's "
            "CPU kernels are built for")


def level(name: str) -> IsaLevel:
    return LEVELS[LEVEL_NAMES.index(name)]


def main() -> int:
    """For scripts (.ci/run): the levels a process here may load, lowest first, one a line."""
    try:
        print("\n".join(allowed_levels()))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
