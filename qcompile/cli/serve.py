"""``qcompile serve``: Triton Inference Server on a model repository written by ``qcompile lower --target triton``."""
from __future__ import annotations

import signal
import tempfile
import threading
from pathlib import Path
from typing import Optional

import typer


def serve_cmd(
    repository: Path = typer.Argument(..., help="Triton model repository (from 'qcompile lower --target triton')."),
    host: str = typer.Option("127.0.0.1", help="Address the HTTP, gRPC and metrics endpoints bind to."),
    http_port: int = typer.Option(8000, help="HTTP port (KServe v2 + generate extension)."),
    grpc_port: int = typer.Option(8001, help="gRPC port."),
    metrics_port: int = typer.Option(8002, help="Prometheus metrics port."),
    log_file: Optional[Path] = typer.Option(None, help="Server log (default: a temporary file, printed)."),
):
    """Start Triton Inference Server on REPOSITORY; Ctrl-C or SIGTERM stops it cleanly."""
    from backends.triton.runtime import ServerOptions, TritonServer
    from compiler.errors import ConfigError
    from qcompile.cli.console import out

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
