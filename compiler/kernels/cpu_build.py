"""Build qcompile's C++ CPU kernels (``csrc/``) once per ISA level, whatever the build host's CPU.

Every source is compiled for every level of ``cpu_isa.LEVELS`` with that level's flags, and each
level's objects are linked into a library of its own, ``qcompile_cpu_<level>.so``, which registers
its ops as ``torch.ops.qcompile_cpu_<level>``. A library is only loaded on a CPU that runs its level
(``cpu_ext``), so code of a higher level never runs where it would stop with SIGILL, and no two
levels share an inline function's copy (as objects of several levels linked into one library
could). One ninja file builds them all, in parallel, rebuilding only what changed.

The libraries live in ``~/.cache/qcompile/cpu-kernels/<torch version>-<key>/`` (``QCOMPILE_KERNELS_DIR``
overrides), keyed by the compiler and the flags; a stamp of the sources' contents lets a process
load them without running ninja when nothing changed. Two processes building at once take turns
(a lock file). torch's headers and libraries come from ``torch.utils.cpp_extension``'s paths, the
compiler from ``$CXX`` (default ``c++``), ninja from PATH or beside the Python executable.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from compiler.errors import QCompileError
from compiler.kernels.cpu_isa import LEVELS

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("dense.cpp", "w4a8.cpp", "w8a8.cpp", "fp8.cpp", "paged_decode.cpp", "layer_ops.cpp", "library.cpp")
# -fopenmp: at::parallel_for is inline OpenMP in ATen's headers, so without it the kernels run on one
# thread; its `omp simd` loops vectorise without -ffast-math, which would change the FP8 rounding and
# NaN handling kept exact. -ffp-contract=off: GCC would otherwise fuse a * b + c into an FMA, and
# rope_qk would no longer be bit for bit torch's.
COMMON_FLAGS = ("-std=c++20", "-O3", "-fPIC", "-fopenmp", "-ffp-contract=off",
                f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
DIR_SWITCH = "QCOMPILE_KERNELS_DIR"


class BuildError(QCompileError):
    """The kernels did not build (no compiler or ninja, a failed build); the message's first line says why,
    the rest is the build log."""


def library_name(level_name: str) -> str:
    return f"qcompile_cpu_{level_name}"


def compiler() -> str:
    return os.environ.get("CXX", "c++")


def _ninja() -> str:
    found = shutil.which("ninja") or str(Path(sys.executable).with_name("ninja"))
    if not Path(found).exists():
        raise BuildError("ninja is not installed (pip install ninja)")
    return found


def build_dir() -> Path:
    """Where the libraries are built: one folder per torch version, compiler and set of flags."""
    if configured := os.environ.get(DIR_SWITCH):
        return Path(configured)
    key = hashlib.sha256(repr((compiler(), COMMON_FLAGS, [lv.cflags for lv in LEVELS])).encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "qcompile" / "cpu-kernels" / f"torch-{torch.__version__}-{key}"


def library_path(level_name: str) -> Path:
    return build_dir() / f"{library_name(level_name)}.so"


def sources_stamp() -> str:
    """A digest of every source and header: what the built libraries were built from."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def _ninja_file() -> str:
    from torch.utils import cpp_extension

    includes = " ".join(f"-isystem {p}" for p in cpp_extension.include_paths())
    torch_lib = cpp_extension.library_paths()[0]
    lines = ["ninja_required_version = 1.3", f"cxx = {compiler()}", f"common = {' '.join(COMMON_FLAGS)} {includes}",
             f"ldflags = -shared -fopenmp -L{torch_lib} -lc10 -ltorch_cpu -ltorch",
             "rule compile", "  command = $cxx -MMD -MF $out.d $common $level_flags -DQC_LIBRARY=$library -c $in -o $out",
             "  depfile = $out.d", "  deps = gcc", "rule link", "  command = $cxx $in $ldflags -o $out"]
    for lv in LEVELS:
        objects = []
        for source in SOURCES:
            obj = f"{lv.name}/{Path(source).stem}.o"
            objects.append(obj)
            lines += [f"build {obj}: compile {CSRC / source}", f"  level_flags = {' '.join(lv.cflags)}",
                      f"  library = {library_name(lv.name)}"]
        lines.append(f"build {library_name(lv.name)}.so: link {' '.join(objects)}")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _locked(folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build(verbose: bool = False) -> Path:
    """Build every level's library (or find them built from these sources); returns their folder.
    ``BuildError`` when the compiler or ninja fails."""
    folder = build_dir()
    stamp = folder / "sources.stamp"
    current = sources_stamp()
    if not verbose and stamp.exists() and stamp.read_text() == current and all(library_path(lv.name).exists() for lv in LEVELS):
        return folder
    with _locked(folder):
        (folder / "build.ninja").write_text(_ninja_file())
        run = subprocess.run([_ninja(), "-C", str(folder)], stdout=None if verbose else subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        if run.returncode != 0:
            log = run.stdout or ""
            first = next((line for line in log.splitlines() if "error" in line), "the build failed")
            raise BuildError(f"{first.strip()[:300]}\n{log}")
        stamp.write_text(current)
    return folder
