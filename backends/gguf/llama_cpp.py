"""Where the llama.cpp build of ``scripts/setup_llama_cpp.sh`` is, and its Python binding loaded from it.

One CMake build of the sources llama-cpp-python vendors serves every use: ``llama_cpp`` (the
binding, installed without a library of its own) loads its ``libllama.so`` through
``LLAMA_CPP_LIB_PATH``, and the tools (``llama-server``, ``llama-imatrix``, ``llama-perplexity``,
``llama-quantize``) sit in the same ``build/bin``. The build is native to the CPU, so its folder is
keyed by the CPU's flags (``python -m backends.gguf.llama_cpp --build-dir VERSION`` prints it).
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from compiler.errors import ConfigError
from compiler.kernels.cpu_isa import cpu_flags, cpuinfo_field

VERSION = "0.3.36"  # llama-cpp-python's release, whose vendored llama.cpp is built
DIR_SWITCH = "QCOMPILE_LLAMA_CPP_DIR"
SETUP = "bash scripts/setup_llama_cpp.sh"


def build_dir(version: str = VERSION) -> Path:
    """The folder of this CPU's build of ``version``."""
    cpu = f"{cpuinfo_field('model name')}|{' '.join(sorted(cpu_flags()))}"
    key = hashlib.sha256(cpu.encode()).hexdigest()[:12]
    root = Path(os.environ[DIR_SWITCH]) if os.environ.get(DIR_SWITCH) else Path.home() / ".cache" / "qcompile" / "llama.cpp"
    return root / f"{version}-{key}"


def missing_reason() -> str | None:
    """Why llama.cpp cannot be used here (None: it can)."""
    if not (build_dir() / "ready").exists():
        return f"llama.cpp is not built for this CPU ({build_dir()}); run `{SETUP}`"
    return None


def tool(name: str) -> Path:
    """A llama.cpp tool of the build (``llama-server``, ``llama-imatrix``, ...)."""
    if why := missing_reason():
        raise ConfigError(why)
    path = build_dir() / "build" / "bin" / name
    if not path.exists():
        raise ConfigError(f"llama.cpp's {name} is missing from {path.parent}; run `{SETUP}` again")
    return path


def library_dir() -> Path:
    return build_dir() / "build" / "bin"


def import_llama_cpp():
    """The ``llama_cpp`` module, bound to this CPU's build (``ConfigError`` if there is none)."""
    if "llama_cpp" not in sys.modules:
        if why := missing_reason():
            raise ConfigError(why)
        os.environ["LLAMA_CPP_LIB_PATH"] = str(library_dir())
    import llama_cpp

    return llama_cpp


if __name__ == "__main__":
    if sys.argv[1:2] == ["--build-dir"]:
        print(build_dir(*sys.argv[2:3]))
