"""The main job's serving stage: a few concurrent prompts through the engine, streamed."""
from __future__ import annotations

import asyncio
import time

from rich.console import Console
from rich.table import Table

DEMO_PROMPTS = ["def fibonacci(n):", "import os\n\ndef list_files(path):", "class Stack:",
                "# Sort a list of numbers\n"]


def serve_demo(console: Console, artifact: str, max_tokens: int = 16) -> list[dict]:
    """Serve DEMO_PROMPTS concurrently (continuous batching) and print tokens/s and TTFT per request."""
    from serving.engine import Engine

    engine = Engine.from_artifact(artifact)
    start = time.perf_counter()

    async def one(prompt: str) -> dict:
        t0, first, n, text = time.perf_counter(), None, 0, []
        async for event in engine.generate_stream(prompt=prompt, max_tokens=max_tokens):
            first = first or time.perf_counter() - t0
            n += len(event.token_ids)
            text.append(event.text)
        elapsed = time.perf_counter() - t0
        return {"prompt": prompt, "tokens": n, "ttft_s": first, "tok_s": n / elapsed, "text": "".join(text)}

    async def all_of_them():
        return await asyncio.gather(*(one(p) for p in DEMO_PROMPTS))

    rows = asyncio.run(all_of_them())
    wall = time.perf_counter() - start
    plan = engine.plan
    table = Table(title=f"serving {len(rows)} concurrent prompts (paged KV: {engine.cache.spec.num_blocks} blocks × "
                        f"{plan.block_size} tokens, {engine.cache.spec.dtype}, {engine.device})")
    for col in ("prompt", "tokens", "TTFT ms", "tok/s", "completion"):
        table.add_column(col, justify="left" if col in ("prompt", "completion") else "right")
    for r in rows:
        table.add_row(repr(r["prompt"]), str(r["tokens"]), f"{1000 * r['ttft_s']:.0f}", f"{r['tok_s']:.1f}",
                      repr(r["text"]))
    console.print(table)
    total = sum(r["tokens"] for r in rows)
    console.print(f"aggregate: {total} tokens in {wall:.1f} s = {total / wall:.1f} tok/s "
                  f"(max {engine.scheduler.stats.max_running} sequences per step)")
    return rows
