#!/usr/bin/env bash
# The kernel tests, the layers and the serving engine at each ISA level below this CPU's best (.ci/run
# runs it after the suite). The suite itself runs every C++ kernel test at each level the CPU has
# (tests/conftest.py's `isa` fixture, in one process); here each level's whole process is capped
# (QCOMPILE_CPU_ISA, and torch's own kernels with ATEN_CPU_CAPABILITY), as on a CPU of that level,
# and the layers and the engine, which take the process's level, run at it too. Nothing to do on a
# CPU whose best level is the lowest (AVX2).
set -euo pipefail
cd "$(dirname "$0")/.."
listed=$(.venv/bin/python -m compiler.kernels.cpu_isa)
mapfile -t levels <<< "$listed"
if [ "${#levels[@]}" -lt 2 ]; then
  echo "== one ISA level here (${listed:-none}): the suite has run it"
  exit 0
fi
for level in "${levels[@]:0:${#levels[@]}-1}"; do
  case "$level" in avx2*) torch_level=avx2 ;; *) torch_level=avx512 ;; esac
  echo "== the kernels, the layers and the engine at QCOMPILE_CPU_ISA=$level (torch at $torch_level)"
  QCOMPILE_CPU_ISA=$level ATEN_CPU_CAPABILITY=$torch_level .venv/bin/python -m pytest -q -p no:cacheprovider \
    -m "not slow and not integration" tests/compiler/kernels tests/compiler/formats tests/compiler/model tests/serving "$@"
done
