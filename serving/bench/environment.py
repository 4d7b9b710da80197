"""The environment a result was measured in, recorded beside every result."""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("qcompile", "torch", "numpy", "transformers", "onnxruntime", "tritonclient", "triton")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    from compiler.kernels.cpu_isa import cpuinfo_field

    return cpuinfo_field("model name") or platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> dict:
    """HEAD of the qcompile checkout and whether it has uncommitted changes (None outside git)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip())
        return {"commit": head.stdout.strip(), "dirty": dirty}
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}


def manifest_sha256(artifact_dir: str | Path | None) -> str | None:
    """SHA-256 of an artifact's manifest.json (it lists every tensor's checksum, so it names the weights)."""
    if artifact_dir is None:
        return None
    path = Path(artifact_dir) / "manifest.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def environment(artifact_dir: str | Path | None = None) -> dict:
    """Hardware, software versions, git commit and the artifact's manifest hash."""
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    from compiler.kernels.cpu_isa import host_levels

    return {
        "hardware": {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "memory_gib": _memory_gib(),
                     "machine": platform.machine(), "cpu_isa_levels": list(host_levels()), "gpu": gpu},
        "software": {"python": sys.version.split()[0], "os": platform.platform(),
                     **{p: _version(p) for p in PACKAGES}},
        "git": git_commit(),
        "artifact_manifest_sha256": manifest_sha256(artifact_dir),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
