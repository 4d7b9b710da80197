"""Running a real Triton Inference Server on a lowered model repository.

Two binaries are supported, found in this order:
  1. a system ``tritonserver`` on PATH (NVIDIA's containers ship it in /opt/tritonserver);
  2. the one carried by the ``nvidia-pytriton`` wheel (Triton 2.51).

The wheel's Python backend looks for ``triton_python_backend_stub`` only beside
``libtriton_python.so``, and its stub crashes on BYTES inputs under numpy 2.x. So
``prepare_runtime`` builds, once per machine, a runtime folder::

    ~/.cache/qcompile/triton-py3.11-<env>/    one per Python environment ($QCOMPILE_TRITON_HOME overrides)
      backends/python/libtriton_python.so    copied from the wheel
      backends/python/triton_python_backend_stub   the stub for the running Python
      venv/                                  a small venv for the server's stub processes:
        site-packages/numpy (1.26)           first on sys.path, so the stub sees numpy 1.26
        site-packages/qcompile-env.pth       then this environment's site-packages (torch, ...)

The stub embeds libpython and takes its prefix from the first ``python3`` on PATH (it ignores
PYTHONPATH), so ``server_env`` puts ``venv/bin`` first: the server side runs with numpy 1.26
while the project's own environment keeps numpy 2. ``scripts/setup.sh`` calls
``python -m backends.triton.runtime`` so a fresh machine has it ready.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from backends.server_process import ServerProcess
from compiler.errors import QCompileError

SERVER_NUMPY = "numpy==1.26.4"  # the wheel's stub reads BYTES tensors correctly only under numpy 1.x
PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
EXIT_TIMEOUT_S = 20  # Triton's own wait for in-flight requests on shutdown; we SIGKILL only after more


class TritonServerError(QCompileError):
    """The Triton server could not be found, prepared, started, or did not become ready."""


def runtime_home() -> Path:
    """One runtime per Python environment: its server venv points at that environment's packages."""
    import hashlib

    env_id = hashlib.sha256(sys.prefix.encode()).hexdigest()[:8]
    return Path(os.environ.get("QCOMPILE_TRITON_HOME", Path.home() / ".cache" / "qcompile" / f"triton-py{PY_VERSION}-{env_id}"))


def _wheel_dir() -> Path | None:
    import importlib.util

    # Located, not imported: installed with --no-deps, the wheel's Python side may not import.
    spec = importlib.util.find_spec("pytriton")
    return Path(spec.origin).resolve().parent if spec and spec.origin else None


@dataclass(frozen=True)
class TritonInstall:
    """Where the server binary, its shared libraries and its backends are."""

    binary: Path
    backend_dir: Path
    lib_dir: Path | None  # extra LD_LIBRARY_PATH entry (the wheel's bundled libraries)
    python_bin: Path  # first on PATH: the stub's Python environment
    system: bool


def find_install() -> TritonInstall:
    """The system tritonserver if on PATH, else the prepared runtime of the nvidia-pytriton wheel.

    ``QCOMPILE_TRITONSERVER=wheel`` forces the wheel's server: a system server's Python-backend stub
    is built for the image's Python, which must then be the project's (3.11) with numpy 1.x.
    """
    choice = os.environ.get("QCOMPILE_TRITONSERVER", "auto")
    if choice not in ("auto", "system", "wheel"):
        raise TritonServerError(f"QCOMPILE_TRITONSERVER={choice!r}: use auto, system or wheel")
    system = shutil.which("tritonserver") if choice != "wheel" else None
    if choice == "system" and not system:
        raise TritonServerError("QCOMPILE_TRITONSERVER=system but no tritonserver on PATH")
    if system:
        binary = Path(system).resolve()
        backend_dir = Path(os.environ.get("TRITON_BACKEND_DIR", binary.parents[1] / "backends"))
        return TritonInstall(binary, backend_dir, None, Path(sys.executable).parent, True)
    wheel = _wheel_dir()
    if wheel is None:
        raise TritonServerError("no tritonserver on PATH and the nvidia-pytriton wheel is not installed; run scripts/setup.sh")
    home = runtime_home()
    if not (home / "backends" / "python" / "triton_python_backend_stub").exists() or not (home / "venv" / "ready").exists():
        raise TritonServerError(f"the Triton runtime in {home} is not prepared; run 'python -m backends.triton.runtime' (scripts/setup.sh does)")
    return TritonInstall(wheel / "tritonserver" / "bin" / "tritonserver", home / "backends", wheel.parent / "nvidia_pytriton.libs",
                         home / "venv" / "bin", False)


def prepare_runtime(home: Path | None = None) -> Path:
    """Build the runtime folder (backend copy + stub + numpy 1.26); idempotent."""
    wheel = _wheel_dir()
    if wheel is None:
        raise TritonServerError("the nvidia-pytriton wheel is not installed; pip install --no-deps nvidia-pytriton")
    home = home or runtime_home()
    python_dir = home / "backends" / "python"
    stub = wheel / "tritonserver" / "python_backend_stubs" / PY_VERSION / "triton_python_backend_stub"
    if not stub.exists():
        raise TritonServerError(f"nvidia-pytriton has no Python backend stub for Python {PY_VERSION}")
    python_dir.mkdir(parents=True, exist_ok=True)
    for f in [*(wheel / "tritonserver" / "backends" / "python").iterdir(), stub]:
        if f.is_file():
            _install_file(f, python_dir / f.name)
    if not (home / "venv" / "ready").exists():
        _build_server_venv(home / "venv")
    return home


def _install_file(src: Path, dst: Path) -> None:
    """Copy unless already identical; replace by rename, since a running server may hold ``dst`` open."""
    import filecmp

    if dst.exists() and filecmp.cmp(src, dst, shallow=False):
        return
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def _build_server_venv(venv: Path) -> None:
    """numpy 1.26 in its own site-packages, then (through a .pth) this environment's packages."""
    import sysconfig

    shutil.rmtree(venv, ignore_errors=True)
    base = Path(sys.base_prefix) / "bin" / f"python{PY_VERSION}"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / f"python{PY_VERSION}" / "site-packages"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), SERVER_NUMPY], check=True)
    # A .pth line starting with "import" runs: addsitedir also processes that dir's own .pth files
    # (editable installs). Added after the venv's own site-packages, so numpy 1.26 wins.
    (site / "qcompile-env.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    (venv / "ready").write_text(SERVER_NUMPY + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerOptions:
    repository: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    log_verbose: int = 0
    extra_args: list[str] = field(default_factory=list)


def server_command(install: TritonInstall, opts: ServerOptions) -> list[str]:
    """The one start command: the tests, ``qcompile serve`` and the containers all use it."""
    return [str(install.binary), f"--model-repository={Path(opts.repository).resolve()}",
            f"--backend-directory={install.backend_dir}",
            f"--http-address={opts.host}", f"--http-port={opts.http_port}",
            f"--grpc-address={opts.host}", f"--grpc-port={opts.grpc_port}",
            f"--metrics-address={opts.host}", f"--metrics-port={opts.metrics_port}",
            "--allow-metrics=true", "--exit-on-error=true", "--strict-readiness=true", f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            f"--log-verbose={opts.log_verbose}", *opts.extra_args]


def server_env(install: TritonInstall) -> dict[str, str]:
    """Environment for the server: the stub must import torch, the project and (wheel) numpy 1.26."""
    import sysconfig

    env = os.environ.copy()
    # The stub links libpython3.X.so: load the one of this interpreter, not another build of the same
    # minor version (Debian's 3.11.2 against pyenv's 3.11.7 stdlib fails on missing symbols).
    libs = [sysconfig.get_config_var("LIBDIR"), str(install.lib_dir) if install.lib_dir else None, env.get("LD_LIBRARY_PATH")]
    env["LD_LIBRARY_PATH"] = ":".join(p for p in libs if p)
    # The stub embeds libpython and finds its prefix (and so its site-packages) through PATH.
    env["PATH"] = f"{install.python_bin}:{env.get('PATH', '')}"
    # The stub ignores PYTHONPATH; model.py puts these first on sys.path (this checkout's code wins).
    paths = [str(PROJECT_ROOT), *[p for p in env.get("PYTHONPATH", "").split(":") if p]]
    env["QCOMPILE_PYTHONPATH"] = ":".join(dict.fromkeys(paths))
    return env


class TritonServer(ServerProcess):
    """A tritonserver child process: ``start()`` waits for readiness, ``stop()`` shuts it down cleanly
    (SIGINT: Triton drains, unloads models and exits; SIGKILL to its session, the stubs too, if it hangs)."""

    what, error, poll_s = "tritonserver", TritonServerError, 0.25
    start_timeout_s, stop_timeout_s = 180.0, EXIT_TIMEOUT_S + 25

    def __init__(self, opts: ServerOptions, install: TritonInstall | None = None, log_path: Path | None = None):
        super().__init__(log_path)
        self.opts = opts
        self.install = install or find_install()

    @property
    def http_url(self) -> str:
        return f"{self.opts.host}:{self.opts.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.opts.host}:{self.opts.grpc_port}"

    def command(self) -> list[str]:
        return server_command(self.install, self.opts)

    def env(self) -> dict[str, str]:
        return server_env(self.install)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False


if __name__ == "__main__":
    print(f"Triton runtime ready in {prepare_runtime()}")
