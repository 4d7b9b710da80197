"""llama.cpp's OpenAI-compatible server (``llama-server`` of the build in ``llama_cpp.py``) on a GGUF file.

    qcompile serve MODEL.gguf --engine llama.cpp     # 127.0.0.1:8000, /v1/completions, /v1/chat/completions
    qcompile bench openai://127.0.0.1:8000           # measured like vLLM and qcompile's engine

``parallel`` slots decode concurrently in one continuous batch (llama.cpp's ``--parallel``), each
with ``ctx_per_request`` tokens of its cache (``--ctx-size`` is their sum); the KV cache is
llama.cpp's default float16.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from backends.gguf.llama_cpp import tool
from compiler.errors import ConfigError, QCompileError

STOP_TIMEOUT_S = 30.0


class LlamaServerError(QCompileError):
    """llama-server did not start, or stopped before it was ready."""


@dataclass(frozen=True)
class LlamaServerOptions:
    model: Path
    host: str = "127.0.0.1"
    port: int = 8000
    parallel: int = 16
    ctx_per_request: int = 2048
    threads: int | None = None  # default: every core

    def command(self) -> list[str]:
        threads = self.threads or os.cpu_count() or 1
        return [str(tool("llama-server")), "-m", str(self.model), "--host", self.host, "--port", str(self.port),
                "-a", self.name, "--parallel", str(self.parallel), "--ctx-size", str(self.parallel * self.ctx_per_request),
                "--threads", str(threads), "--threads-batch", str(threads), "--cont-batching", "--no-webui"]

    @property
    def name(self) -> str:
        """The model id the server answers to: the file's path, as vLLM names a local checkpoint."""
        return str(Path(self.model).resolve())


class LlamaServer:
    """A ``llama-server`` child process: ``start()`` waits for readiness, ``stop()`` shuts it down."""

    def __init__(self, opts: LlamaServerOptions, log_path: Path | None = None):
        if not Path(opts.model).is_file() or Path(opts.model).suffix != ".gguf":
            raise ConfigError(f"{opts.model}: not a .gguf file; write one with 'qcompile lower ARTIFACT --target gguf -o MODEL.gguf'")
        self.opts, self.log_path = opts, log_path
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{self.opts.host}:{self.opts.port}"

    @property
    def model(self) -> str:
        return self.opts.name

    def start(self, timeout_s: float = 300.0) -> "LlamaServer":
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(self.opts.command(), stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                hint = f"; see its log {self.log_path}" if self.log_path else ""
                raise LlamaServerError(f"llama-server exited with code {self.process.returncode} before it was ready{hint}")
            if self.ready():
                return self
            time.sleep(0.3)
        self.stop()
        raise LlamaServerError(f"llama-server was not ready after {timeout_s:.0f} s")

    def ready(self) -> bool:
        """The model is loaded (``/health`` answers 200 only then) and listed under its id."""
        try:
            with urllib.request.urlopen(f"http://{self.url}/health", timeout=2) as r:
                if r.status != 200:
                    return False
            with urllib.request.urlopen(f"http://{self.url}/v1/models", timeout=2) as r:
                return any(m.get("id") == self.model for m in json.load(r).get("data", []))
        except (OSError, ValueError):
            return False

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGINT (llama-server finishes and exits), SIGKILL to its group if it hangs; the exit code."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else None
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait()

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
