"""``qcompile generate ARTIFACT "prompt"``: stream a completion from the serving engine."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Optional

import typer

from qcompile.cli.options import check_device, device_option


def generate_cmd(
    artifact: Path = typer.Argument(..., help="Artifact directory (compiled with or without the paged_kv pass)."),
    prompt: str = typer.Argument(..., help="Prompt text."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0: all)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling threshold."),
    seed: Optional[int] = typer.Option(None, help="Seed for reproducible sampling."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string; repeat the flag for more (not a comma list: a stop string may hold a comma)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep going past the end-of-sequence token."),
    device: Optional[str] = device_option(None, " (default: cuda when available, else cpu)"),
    int4_compute: Optional[str] = typer.Option(None, help="How INT4 layers compute: auto (w4a8 on a CPU that runs it), "
                                                         "w4a16 (the format) or w4a8 (int8 activations, faster on the CPU); default: "
                                                         "the artifact's plan."),
):
    """Generate a completion of PROMPT with ARTIFACT, streamed as it is produced."""
    from rich.markup import escape

    from qcompile.cli.console import err
    from qcompile.cli.console import out as console
    from serving.engine import Engine
    from serving.engine_setup import describe_kernels
    from serving.types import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            stop=tuple(stop), ignore_eos=ignore_eos)  # refused here, before the model loads
    engine = Engine.from_artifact(artifact, check_device(device), **({"int4_compute": int4_compute} if int4_compute else {}))

    async def run() -> tuple[int, str, float | None]:
        n, reason, first = 0, "", None
        start = time.perf_counter()
        async for event in engine.generate_stream(prompt=prompt, params=params):
            first = first if first is not None else time.perf_counter() - start
            n += len(event.token_ids)
            console.print(event.text, end="", markup=False, highlight=False, soft_wrap=True)
            reason = event.finish_reason or reason
        return n, reason, first

    start = time.perf_counter()
    n, reason, ttft = asyncio.run(run())
    elapsed = time.perf_counter() - start
    console.print()
    report = engine.load_report
    err.print(f"[dim]{n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tok/s, first token {1000 * (ttft or 0):.0f} ms), finish: {reason}"
              f"{', INT4: ' + report.int4['compute'] if report.int4 else ''}[/dim]")
    err.print(f"[dim]kernels: {escape(describe_kernels(report.kernels))}[/dim]")
