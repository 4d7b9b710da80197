"""A server child process every engine backend starts the same way (tritonserver, vllm serve,
llama-server): started in its own session with its output in a log, waited for until ``ready()``,
stopped with SIGINT and, if it hangs, SIGKILL to its whole process group."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from compiler.errors import QCompileError


class ServerProcess:
    """Subclasses give ``what`` (the name in messages), ``error`` (the exception raised),
    ``command()``, ``ready()`` and, optionally, ``env()``, ``poll_s``, ``start_timeout_s`` and ``stop_timeout_s``."""

    what = "server"
    error: type[QCompileError] = QCompileError
    poll_s = 0.5
    start_timeout_s = 300.0
    stop_timeout_s = 30.0

    def __init__(self, log_path: Path | None = None):
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str] | None:
        return None  # the parent's

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout_s: float | None = None) -> "ServerProcess":
        """Start the server and wait until ``ready()``; its early exit or a timeout raises ``error``."""
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command(), env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self.error(f"{self.what} exited with code {self.process.returncode} before it was ready{self.log_hint()}")
            if self.ready():
                return self
            time.sleep(self.poll_s)
        self.stop()
        raise self.error(f"{self.what} was not ready after {timeout_s:.0f} s{self.log_hint()}")

    def log_hint(self) -> str:
        return f"; see its log {self.log_path}" if self.log_path else "; rerun with a log to see why"

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGINT (the server finishes and exits), SIGKILL to its group if it hangs; the exit code.
        Whatever it started in its session (an engine core, backend stubs) is killed with it."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else None
        self.process.send_signal(signal.SIGINT)
        try:
            code = self.process.wait(self.stop_timeout_s if timeout_s is None else timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.wait()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return code

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
