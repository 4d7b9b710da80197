"""``qcompile serve``: Triton Inference Server on a model repository written by ``qcompile lower --target triton``,
or (``--engine vllm``) vLLM's OpenAI-compatible server on a checkpoint written by ``qcompile lower --target vllm``,
or (``--engine llama.cpp``) llama.cpp's ``llama-server`` on a file written by ``qcompile lower --target gguf``."""
from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer


ENGINES = ("triton", "vllm", "llama.cpp")


def serve_cmd(
    repository: Path = typer.Argument(..., help="Triton model repository (from 'qcompile lower --target triton'), "
                                                "or with --engine vllm a checkpoint (from 'qcompile lower --target vllm'), "
                                                "or with --engine llama.cpp a .gguf file (from 'qcompile lower --target gguf')."),
    engine: str = typer.Option("triton", help="triton: Triton Inference Server; vllm / llama.cpp: that engine's "
                                              "OpenAI API on --http-port."),
    host: str = typer.Option("127.0.0.1", help="Address the HTTP, gRPC and metrics endpoints bind to."),
    http_port: int = typer.Option(8000, help="HTTP port: Triton's KServe v2 + generate extension, or vLLM's OpenAI API."),
    grpc_port: int = typer.Option(8001, help="gRPC port (Triton only)."),
    metrics_port: int = typer.Option(8002, help="Prometheus metrics port (Triton only)."),
    log_file: Optional[Path] = typer.Option(None, help="Server log (default: a temporary file, printed)."),
    parallel: Optional[int] = typer.Option(None, min=1, help="llama.cpp only: requests decoded concurrently (its "
                                                                "--parallel slots; default 16)."),
):
    """Start Triton Inference Server (or vLLM) on REPOSITORY; Ctrl-C or SIGTERM stops it cleanly."""
    from backends.triton.runtime import ServerOptions, TritonServer
    from compiler.errors import ConfigError
    from qcompile.cli.console import out

    if engine not in ENGINES:
        raise ConfigError(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")
    if engine == "vllm":
        return serve_vllm(repository, host, http_port, log_file)
    if engine == "llama.cpp":
        return serve_llama_cpp(repository, host, http_port, log_file, parallel or 16)
    if parallel is not None:
        raise ConfigError(f"--parallel sets llama.cpp's slots; --engine {engine} does not take it")

    if not any(repository.glob("*/config.pbtxt")):
        raise ConfigError(f"{repository}: no <model>/config.pbtxt inside; write one with 'qcompile lower ARTIFACT --target triton -o {repository}'")
    log = log_file or Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])
    server = TritonServer(ServerOptions(repository, host, http_port, grpc_port, metrics_port), log_path=log)
    out.print(f"starting {'system' if server.install.system else 'nvidia-pytriton'} tritonserver ({server.install.binary}); log {log}")
    models = ", ".join(sorted(p.parent.name for p in repository.glob("*/config.pbtxt")))
    _run_until_stopped(server, lambda: out.print(
        f"[bold green]ready[/bold green]: models {models}\n  HTTP    http://{server.http_url}  (POST /v2/models/<model>/generate_stream)\n"
        f"  gRPC    {server.grpc_url}\n  metrics http://{host}:{metrics_port}/metrics\nCtrl-C to stop"), "tritonserver")


def serve_vllm(checkpoint: Path, host: str, port: int, log_file: Optional[Path]) -> None:
    """``vllm serve CHECKPOINT`` on HOST:PORT until Ctrl-C or SIGTERM (the stop is clean either way)."""
    from backends.vllm.runtime import VllmOptions, VllmServer
    from qcompile.cli.console import out

    server = VllmServer(VllmOptions(checkpoint, host, port))
    server.check_host()  # a checkpoint vLLM cannot run here is refused before anything is written or started
    log = log_file or Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
    server.log_path = log
    out.print(f"starting vLLM ({server.python}) on {checkpoint}; log {log} (a minute or more on a CPU)")
    _run_until_stopped(server, lambda: out.print(
        f"[bold green]ready[/bold green]: model {server.model}\n  OpenAI API http://{server.url}/v1  (POST /v1/completions, "
        f"/v1/chat/completions)\n  bench      qcompile bench openai://{server.url}\nCtrl-C to stop"), "vllm serve")


def serve_llama_cpp(model: Path, host: str, port: int, log_file: Optional[Path], parallel: int) -> None:
    """llama.cpp's ``llama-server`` on MODEL (a .gguf file) on HOST:PORT until Ctrl-C or SIGTERM."""
    from backends.gguf.server import LlamaServer, LlamaServerOptions
    from qcompile.cli.console import out

    log = log_file or Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    server = LlamaServer(LlamaServerOptions(model, host, port, parallel=parallel), log_path=log)
    out.print(f"starting llama.cpp's llama-server on {model} ({parallel} slots); log {log}")
    _run_until_stopped(server, lambda: out.print(
        f"[bold green]ready[/bold green]: model {server.model}\n  OpenAI API http://{server.url}/v1  (POST /v1/completions, "
        f"/v1/chat/completions)\n  bench      qcompile bench openai://{server.url}\nCtrl-C to stop"), "llama-server")


class StopRequested(BaseException):
    """SIGTERM arrived: raised from the signal handler, so that it ends a server's start-up wait too. A signal
    like KeyboardInterrupt, not an error: no ``except Exception`` on the way may swallow it."""


def _run_until_stopped(server, on_ready, what: str) -> None:
    """Start ``server``, report readiness, wait for Ctrl-C, SIGTERM or the server's own exit, stop it.
    Ctrl-C and SIGTERM (how containers stop) interrupt the start-up wait as well as the serving."""
    from qcompile.cli.console import out

    def on_sigterm(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop is enough: never interrupt the stop itself
        raise StopRequested

    stopped = False
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        server.start()
        on_ready()
        while server.process.poll() is None:
            time.sleep(0.5)
    except (KeyboardInterrupt, StopRequested):
        stopped = True
    finally:
        code = server.stop()
        signal.signal(signal.SIGTERM, previous)
    out.print(f"{what} stopped (exit code {code})")
    if code not in (0, None) and not stopped:
        raise typer.Exit(1)
