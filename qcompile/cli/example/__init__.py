"""The main job: the whole pipeline as it stands, end to end, on the built-in SmolLM2-135M.

Each variant is a pipeline file in ``examples/``; every one is compiled from the same loaded
checkpoint, reloaded from its artifact and evaluated by the shared perplexity protocol.
"""
from __future__ import annotations

import copy
import time
from importlib import resources
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from compiler.io.artifact import load_artifact
from compiler.io.load import load_checkpoint
from compiler.io.summary import artifact_summary
from compiler.pipeline import PipelineConfig
from compiler.pipeline.compile import compile_loaded
from compiler.pipeline.evaluate import evaluate_perplexity
from qcompile.cli.bench import bench_stage
from qcompile.cli.example.onnx import run_onnx_stage
from qcompile.cli.example.serving import serve_demo
from qcompile.cli.example.triton import run_triton_stage

EXAMPLE_MODEL = "smollm2"
# (label, pipeline file) in the order the table shows them; the first is the baseline.
VARIANTS = [("float", "float.toml"), ("awq-g128-32samples", "awq_g128.toml"), ("fp8", "fp8.toml"),
            ("awq+distill", "awq_distill.toml")]
PROMPT = "def fibonacci(n):"


def example_pipeline(name: str) -> Path:
    """A pipeline file shipped in the package (``qcompile/examples/``; ``examples/`` in a checkout)."""
    return Path(str(resources.files("qcompile") / "examples" / name))


def run_example(console: Console, out_dir: Path, windows: int) -> list[dict]:
    console.print(f"[bold]qcompile example[/bold]: {EXAMPLE_MODEL} (SmolLM2-135M-Instruct, GGUF Q4_1 dequantized to float32)")
    source = load_checkpoint(EXAMPLE_MODEL)
    rows = []
    for label, pipeline_file in VARIANTS:
        config = PipelineConfig.from_toml(example_pipeline(pipeline_file))
        console.print(f"compiling [bold]{label}[/bold] ({pipeline_file}) …")
        start = time.perf_counter()
        variant = copy.copy(source)
        variant.model = copy.deepcopy(source.model)
        result = compile_loaded(variant, config, out_dir / label, force=True)
        compile_s = time.perf_counter() - start
        artifact = load_artifact(result.path)
        ppl = evaluate_perplexity(artifact, "pydoc", windows)
        size = artifact_summary(result.path)["size"]["weights_bytes"]
        rows.append({"variant": label, "ppl": ppl["ppl"], "tokens": ppl["tokens"], "weights_mib": size / 2**20,
                     "compile_s": compile_s, "path": str(result.path)})
    _print_table(console, rows, windows)
    sample = _greedy_sample(load_artifact(rows[0]["path"]))
    console.print(f"greedy sample from the float artifact: {PROMPT!r} → {sample!r}")
    # Deployment stages, each on the artifacts compiled above.
    run_onnx_stage(console, rows, out_dir, PROMPT)
    serve_demo(console, rows[0]["path"])
    run_triton_stage(console, Path(rows[0]["path"]), out_dir, PROMPT)
    bench_stage(console, rows[0]["path"])
    return rows


def _greedy_sample(loaded, max_new_tokens: int = 24) -> str:
    ids = torch.tensor([loaded.tokenizer(PROMPT)["input_ids"]])
    outp = loaded.model.generate(ids, max_new_tokens, loaded.model.config.eos_token_ids)
    return loaded.tokenizer.decode(outp[0, ids.shape[1]:], skip_special_tokens=True)


def _print_table(console: Console, rows: list[dict], windows: int) -> None:
    base = rows[0]["ppl"]
    table = Table(title=f"SmolLM2-135M, pydoc, {windows} windows × 512 tokens")
    for col in ("variant", "perplexity", "Δ vs float", "weights MiB", "compile s", "artifact"):
        table.add_column(col, justify="left" if col in ("variant", "artifact") else "right")
    for r in rows:
        table.add_row(r["variant"], f"{r['ppl']:.3f}", f"{100 * (r['ppl'] / base - 1):+.2f}%", f"{r['weights_mib']:.1f}",
                      f"{r['compile_s']:.1f}", r["path"])
    console.print(table)
