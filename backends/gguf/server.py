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
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from backends.gguf.llama_cpp import tool
from backends.server_process import ServerProcess
from compiler.errors import ConfigError, QCompileError


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


class LlamaServer(ServerProcess):
    """A ``llama-server`` child process: ``start()`` waits for readiness, ``stop()`` shuts it down."""

    what, error, poll_s = "llama-server", LlamaServerError, 0.3

    def __init__(self, opts: LlamaServerOptions, log_path: Path | None = None):
        if not Path(opts.model).is_file() or Path(opts.model).suffix != ".gguf":
            raise ConfigError(f"{opts.model}: not a .gguf file; write one with 'qcompile lower ARTIFACT --target gguf -o MODEL.gguf'")
        super().__init__(log_path)
        self.opts = opts

    @property
    def url(self) -> str:
        return f"{self.opts.host}:{self.opts.port}"

    @property
    def model(self) -> str:
        return self.opts.name

    def command(self) -> list[str]:
        return self.opts.command()

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
