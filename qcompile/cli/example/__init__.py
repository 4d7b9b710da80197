"""The main job: the whole pipeline as it stands, end to end, on the built-in SmolLM2-135M.

Each variant is a pipeline file in ``examples/``, compiled from the loaded checkpoint or from an
earlier variant's artifact (``variants.py``), reloaded from its own artifact and evaluated by the
shared perplexity protocol; then the float and first INT4 artifacts go through the deployment stages.
"""
from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console

from compiler.io.artifact import load_artifact
from compiler.io.load import load_checkpoint
from qcompile.cli.bench import bench_stage
from qcompile.cli.example.llama_cpp import run_llama_cpp_stage
from qcompile.cli.example.onnx import run_onnx_stage
from qcompile.cli.example.serving import serve_demo
from qcompile.cli.example.triton import run_triton_stage
from qcompile.cli.example.variants import VARIANTS, Variant, compile_variants, example_pipeline, variants_table

__all__ = ["run_example", "VARIANTS", "Variant", "example_pipeline"]

EXAMPLE_MODEL = "smollm2"
PROMPT = "def fibonacci(n):"


def run_example(console: Console, out_dir: Path, windows: int) -> list[dict]:
    console.print(f"[bold]qcompile example[/bold]: {EXAMPLE_MODEL} (SmolLM2-135M-Instruct, GGUF Q4_1 dequantized to float32)")
    source = load_checkpoint(EXAMPLE_MODEL)
    rows = compile_variants(console, source, out_dir, windows)
    console.print(variants_table(rows, f"SmolLM2-135M, pydoc, {windows} windows × 512 tokens", EXAMPLE_MODEL))
    sample = _greedy_sample(load_artifact(rows[0]["path"]))
    console.print(f"greedy sample from the float artifact: {PROMPT!r} → {sample!r}")
    # Deployment stages, each on the artifacts compiled above.
    run_onnx_stage(console, rows, out_dir, PROMPT)
    serve_demo(console, rows[0]["path"])
    run_triton_stage(console, Path(rows[0]["path"]), out_dir, PROMPT)
    run_llama_cpp_stage(console, rows, out_dir, PROMPT)
    bench_stage(console, rows[0]["path"])
    return rows


def _greedy_sample(loaded, max_new_tokens: int = 24) -> str:
    ids = torch.tensor([loaded.tokenizer(PROMPT)["input_ids"]])
    outp = loaded.model.generate(ids, max_new_tokens, loaded.model.config.eos_token_ids)
    return loaded.tokenizer.decode(outp[0, ids.shape[1]:], skip_special_tokens=True)
