"""The example's deployment stage: lower the float artifact to Triton, serve it, and check that a
gRPC stream returns the same greedy tokens as the in-process engine."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rich.console import Console

from serving.types import SamplingParams


async def _tokens(adapter, prompt: str, params: SamplingParams) -> tuple[list[int], str, float]:
    start, first, ids, text = time.perf_counter(), None, [], ""
    try:
        async for event in adapter.generate(prompt, params):
            first = first or time.perf_counter()
            ids += event.token_ids
            text += event.text
    finally:
        await adapter.close()
    return ids, text, (first - start) * 1e3


def run_triton_stage(console: Console, artifact: Path, out_dir: Path, prompt: str, max_tokens: int = 16) -> bool:
    """Lower, serve on free 127.0.0.1 ports, compare one greedy stream with the engine; True when equal."""
    from backends.triton.runtime import (
        ServerOptions,
        TritonServer,
        free_port,
        prepare_runtime,
    )
    from compiler.deploy.lowering import lower
    from serving.adapters.engine import EngineAdapter
    from serving.adapters.triton_grpc import TritonGrpcAdapter

    params = SamplingParams(max_tokens=max_tokens)
    repo = out_dir / "triton-repo"
    model_dir = lower(artifact, "triton", repo, {"name": "example"}, force=True).path
    console.print(f"lowered to [bold]{model_dir}[/bold]; starting Triton Inference Server …")
    prepare_runtime()
    opts = ServerOptions(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    with TritonServer(opts, log_path=out_dir / "tritonserver.log") as server:
        served, text, ttft = asyncio.run(_tokens(TritonGrpcAdapter(server.grpc_url, "example"), prompt, params))
    local, _, local_ttft = asyncio.run(_tokens(EngineAdapter.from_artifact(artifact), prompt, params))
    same = served == local
    verdict = "[green]same tokens as in-process[/green]" if same else "[red]DIFFERENT from in-process[/red]"
    console.print(f"Triton gRPC stream ({server.grpc_url}): {prompt!r} → {text!r}\n"
                  f"  {verdict}; TTFT {ttft:.0f} ms via Triton, {local_ttft:.0f} ms in-process")
    return same
