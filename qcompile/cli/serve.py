"""``qcompile serve``: Triton Inference Server on a model repository written by ``qcompile lower --target triton``,
or (``--engine vllm``) vLLM's OpenAI-compatible server on a checkpoint written by ``qcompile lower --target vllm``."""
from __future__ import annotations

import signal
import tempfile
import threading
from pathlib import Path
from typing import Optional

import typer


ENGINES = ("triton", "vllm")


def serve_cmd(
    repository: Path = typer.Argument(..., help="Triton model repository (from 'qcompile lower --target triton'), "
                                                "or with --engine vllm a checkpoint (from 'qcompile lower --target vllm')."),
    engine: str = typer.Option("triton", help="triton: Triton Inference Server; vllm: vLLM's OpenAI API on --http-port."),
    host: str = typer.Option("127.0.0.1", help="Address the HTTP, gRPC and metrics endpoints bind to."),
    http_port: int = typer.Option(8000, help="HTTP port (KServe v2 + generate extension)."),
    grpc_port: int = typer.Option(8001, help="gRPC port."),
    metrics_port: int = typer.Option(8002, help="Prometheus metrics port."),
    log_file: Optional[Path] = typer.Option(None, help="Server log (default: a temporary file, printed)."),
):
    """Start Triton Inference Server (or vLLM) on REPOSITORY; Ctrl-C or SIGTERM stops it cleanly."""
    from backends.triton.runtime import ServerOptions, TritonServer
    from compiler.errors import ConfigError
    from qcompile.cli.console import out

    if engine not in ENGINES:
        raise ConfigError(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")
    if engine == "vllm":
        return serve_vllm(repository, host, http_port, log_file)

    if not any(repository.glob("*/config.pbtxt")):
        raise ConfigError(f"{repository}: no <model>/config.pbtxt inside; write one with 'qcompile lower ARTIFACT --target triton -o {repository}'")
    log = log_file or Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])
    server = TritonServer(ServerOptions(repository, host, http_port, grpc_port, metrics_port), log_path=log)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # containers stop with SIGTERM
    out.print(f"starting {'system' if server.install.system else 'nvidia-pytriton'} tritonserver ({server.install.binary}); log {log}")
    server.start()
    models = ", ".join(sorted(p.parent.name for p in repository.glob("*/config.pbtxt")))
    out.print(f"[bold green]ready[/bold green]: models {models}\n  HTTP    http://{server.http_url}  (POST /v2/models/<model>/generate_stream)\n"
              f"  gRPC    {server.grpc_url}\n  metrics http://{host}:{metrics_port}/metrics\nCtrl-C to stop")
    try:
        while not stop.is_set() and server.process.poll() is None:
            stop.wait(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        code = server.stop()
    out.print(f"tritonserver stopped (exit code {code})")
    if code not in (0, None) and not stop.is_set():
        raise typer.Exit(1)


def serve_vllm(checkpoint: Path, host: str, port: int, log_file: Optional[Path]) -> None:
    """``vllm serve CHECKPOINT`` on HOST:PORT until Ctrl-C or SIGTERM (the stop is clean either way)."""
    from backends.vllm.runtime import VllmOptions, VllmServer
    from qcompile.cli.console import out

    log = log_file or Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
    server = VllmServer(VllmOptions(checkpoint, host, port), log_path=log)
    out.print(f"starting vLLM ({server.python}) on {checkpoint}; log {log} (a minute or more on a CPU)")
    _run_until_stopped(server, lambda: out.print(
        f"[bold green]ready[/bold green]: model {server.model}\n  OpenAI API http://{server.url}/v1  (POST /v1/completions, "
        f"/v1/chat/completions)\n  bench      qcompile bench openai://{server.url}\nCtrl-C to stop"), "vllm serve")


def _run_until_stopped(server, on_ready, what: str) -> None:
    """Start ``server``, report readiness, wait for Ctrl-C, SIGTERM or the server's own exit, stop it."""
    from qcompile.cli.console import out

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # containers stop with SIGTERM
    try:
        server.start()
        on_ready()
        while not stop.is_set() and server.process.poll() is None:
            stop.wait(0.5)
    except KeyboardInterrupt:
        stop.set()  # asked for, like SIGTERM
    finally:
        code = server.stop()
    out.print(f"{what} stopped (exit code {code})")
    if code not in (0, None) and not stop.is_set():
        raise typer.Exit(1)
