"""The main job's llama.cpp stage: the first INT4 artifact lowered to GGUF (``qcompile lower --target
gguf``), served by llama.cpp's ``llama-server`` on 127.0.0.1, and one greedy stream compared with
the in-process engine's (both multiply by int8 activations: llama.cpp's Q8_1 blocks of 32, the
engine's W4A8 groups, so the streams may part at a near tie; the stage says where)."""
from __future__ import annotations

import asyncio
from pathlib import Path

from rich.console import Console

from qcompile.cli.example.onnx import stage_rows
from qcompile.cli.example.triton import _tokens
from serving.types import SamplingParams


def run_llama_cpp_stage(console: Console, rows: list[dict], out_dir: Path, prompt: str, max_tokens: int = 16) -> bool | None:
    """True when llama.cpp's greedy tokens equal the engine's; None when llama.cpp is not built here."""
    from backends.gguf.llama_cpp import missing_reason
    from backends.gguf.server import LlamaServer, LlamaServerOptions
    from backends.triton.runtime import free_port
    from compiler.deploy.lowering import lower
    from serving.adapters.engine import EngineAdapter
    from serving.adapters.openai import OpenAIAdapter

    if why := missing_reason():
        console.print(f"llama.cpp stage skipped: {why}")
        return None
    row = stage_rows(rows)[-1]
    lowered = lower(row["path"], "gguf", out_dir / f"{row['variant']}.gguf", force=True)
    path = lowered.path
    layers = {note.split(":")[0] for note in lowered.notes if "Q4_1's m" in note}
    console.print(f"lowered [bold]{row['variant']}[/bold] to [bold]{path}[/bold] ({path.stat().st_size / 1e6:.0f} MB"
                  f"{f', {len(layers)} layers Q4_1' if layers else ''}); starting llama-server …")
    params = SamplingParams(max_tokens=max_tokens)
    opts = LlamaServerOptions(path, port=free_port(), parallel=1)
    with LlamaServer(opts, log_path=out_dir / "llama-server.log") as server:
        served, text, ttft = asyncio.run(_tokens(OpenAIAdapter(server.url, server.model), prompt, params))
    local, _, _ = asyncio.run(_tokens(EngineAdapter.from_artifact(row["path"]), prompt, params))
    same = served == local
    parted = next((i for i, (a, b) in enumerate(zip(served, local)) if a != b), min(len(served), len(local)))
    verdict = "[green]same tokens as the engine[/green]" if same else f"first {parted} tokens the engine's"
    console.print(f"llama.cpp stream ({server.url}): {prompt!r} → {text!r}\n  {verdict}; TTFT {ttft:.0f} ms")
    return same
