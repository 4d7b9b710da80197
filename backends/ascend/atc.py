"""The ATC invocation: options, the ``build_om.sh`` it writes, running it and reading its errors.

ATC facts this follows (CANN 8.x): ``--framework=5`` is ONNX; dynamic sequence lengths only as
gears (``--input_format=ND --input_shape="input_ids:1,-1" --dynamic_dims="128;256;512"``, 2–100
gears, not combinable with ``--dynamic_batch_size``); ``--precision_mode`` (default
``force_fp16``) or ``--precision_mode_v2``, never both; a failure prints ``ATC run failed`` and
lines matching ``^E[0-9A-Z]{5}:``; ``ASCEND_PROCESS_LOG_PATH`` moves the plog directory.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import onnx

from compiler.errors import ConfigError, LoweringIncomplete, QCompileError

SOC_VERSIONS = ("Ascend910B1", "Ascend910B2", "Ascend910B3", "Ascend910B4", "Ascend310P3")
DEFAULT_BUCKETS = (128, 256, 512)
ERROR_LINE = re.compile(r"^(E[0-9A-Z]{5}):\s*(.*)$")
SCRIPT = "build_om.sh"
LOG = "atc.log"
OM_DIR = "om"
GRAPHS = ("prefill", "decode")


class AtcNotFound(LoweringIncomplete):
    """The bundle is written but no ``atc`` is here to build the .om: finish on a CANN host."""

    exit_code = 3


class AtcFailed(QCompileError):
    """ATC ran and failed (or wrote no .om); the message carries its E-codes and nodes."""

    exit_code = 4


@dataclass(frozen=True)
class AtcOptions:
    """How to call ATC: the chip, the prefill length gears and the precision mode."""

    soc: str
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    precision_mode: str | None = None  # None: force_fp16 unless precision_mode_v2 is given
    precision_mode_v2: str | None = None

    def validate(self, max_len: int) -> None:
        if self.soc not in SOC_VERSIONS:
            raise ConfigError(f"unknown --soc {self.soc!r}; use the name 'npu-smi info' shows: {', '.join(SOC_VERSIONS)}")
        b = self.buckets
        if not 2 <= len(b) <= 100:
            raise ConfigError(f"ATC needs 2 to 100 sequence gears (3-4 recommended), got {len(b)}: {list(b)}")
        if list(b) != sorted(set(b)) or b[0] < 1:
            raise ConfigError(f"sequence gears must be positive, distinct and ascending, got {list(b)}")
        if b[-1] > max_len:
            raise ConfigError(f"the largest gear {b[-1]} exceeds --max-len {max_len}; raise --max-len or drop the gear")
        if self.precision_mode and self.precision_mode_v2:
            raise ConfigError("give --precision-mode or --precision-mode-v2, not both (ATC rejects the pair)")

    def precision_flag(self) -> str:
        if self.precision_mode_v2:
            return f"--precision_mode_v2={self.precision_mode_v2}"
        return f"--precision_mode={self.precision_mode or 'force_fp16'}"


def atc_args(opts: AtcOptions, graph: str, om_dir: str) -> list[str]:
    """The arguments after ``atc`` for one graph (prefill gets the sequence gears)."""
    args = ["--framework=5", f"--model={graph}.onnx", f"--output={om_dir}/{graph}", f"--soc_version={opts.soc}",
            "--input_format=ND"]
    if graph == "prefill":
        args += ["--input_shape=input_ids:1,-1", f"--dynamic_dims={';'.join(map(str, opts.buckets))}"]
    return args + [opts.precision_flag(), "--log=error"]


def build_script(opts: AtcOptions) -> str:
    """``build_om.sh``: the exact commands, runnable as is on a CANN host."""
    lines = ["#!/usr/bin/env bash",
             "# Builds the Ascend offline models (.om) from this bundle's ONNX graphs with ATC (CANN 8.x).",
             "# Run on a CANN host: bash build_om.sh   (ATC=/path/to/atc and OM_DIR=dir override the defaults)",
             "set -euo pipefail", 'cd "$(dirname "$0")"', 'ATC="${ATC:-atc}"', f'OM_DIR="${{OM_DIR:-{OM_DIR}}}"',
             'mkdir -p "$OM_DIR"']
    for graph in GRAPHS:
        args = [shlex.quote(a) for a in atc_args(opts, graph, "OMDIR")]
        lines.append('"$ATC" ' + " ".join(args).replace("OMDIR/", '"$OM_DIR"/'))
    return "\n".join(lines) + "\n"


def find_atc(explicit: str | None) -> str | None:
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise ConfigError(f"--atc {explicit}: not an executable file")
        return os.path.abspath(explicit)
    return shutil.which("atc")


def parse_errors(output: str, graphs: dict[str, onnx.ModelProto]) -> list[str]:
    """Each ``E.....:`` line, with the graph node it names (the longest node name found in it)."""
    nodes = {n.name: (g, n.op_type) for g, m in graphs.items() for n in m.graph.node if n.name}
    found = []
    for line in output.splitlines():
        match = ERROR_LINE.match(line.strip())
        if not match:
            continue
        named = [n for n in nodes if n in line]
        where = ""
        if named:
            node = max(named, key=len)
            where = f" [node {node} ({nodes[node][1]}) in {nodes[node][0]}.onnx]"
        found.append(f"{match.group(1)}: {match.group(2)}{where}")
    return found


def run_atc(bundle: Path, atc: str, graphs: dict[str, onnx.ModelProto]) -> list[Path]:
    """Run ``build_om.sh`` in ``bundle``; on success move the .om files into ``bundle/om``.

    The .om files are built in a temporary directory and renamed into place only when every
    one exists, so a failed or interrupted build never leaves an .om that looks complete.
    The combined output is kept in ``atc.log`` and the plogs under ``plog/`` either way.
    """
    tmp = bundle / f".om.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    env = {**os.environ, "ATC": atc, "OM_DIR": str(tmp), "ASCEND_PROCESS_LOG_PATH": str(bundle / "plog"),
           "ASCEND_SLOG_PRINT_TO_STDOUT": "1"}
    try:
        proc = subprocess.run(["bash", SCRIPT], cwd=bundle, env=env, capture_output=True, text=True)
        output = proc.stdout + proc.stderr
        (bundle / LOG).write_text(output)
        errors = parse_errors(output, graphs)
        if proc.returncode != 0 or "ATC run failed" in output or errors:
            shown = "; ".join(errors[:3]) or f"exit status {proc.returncode}, no E-code printed"
            raise AtcFailed(f"ATC run failed: {shown}; full log: {bundle / LOG}")
        oms = {g: sorted(tmp.glob(f"{g}*.om")) for g in GRAPHS}
        missing = [g for g, found in oms.items() if not found]
        if missing:
            raise AtcFailed(f"atc exited 0 but wrote no {', '.join(missing)} .om; see {bundle / LOG}")
        final = bundle / OM_DIR
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        return sorted(final.glob("*.om"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
