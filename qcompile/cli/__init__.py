"""The ``qcompile`` command line. Every user error is one line on stderr and a non-zero exit;
``--debug`` shows the traceback instead."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.text import Text

from compiler.errors import QCompileError
from qcompile import load_plugins
from qcompile.cli.console import err, out
from qcompile.cli.options import emit, json_option, output_json_option

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help=("Quantize, distill and lower decoder LLMs (Llama, Mistral, Qwen2, Qwen3, Gemma 3, "
                        "Qwen3-MoE, Mixtral, DeepSeek-V3) to deployment targets."))
_state = {"debug": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors.")):
    _state["debug"] = debug


@app.command("compile")
def compile_cmd(
    model: str = typer.Argument(..., help="HF directory, .gguf file, artifact, or a built-in model name (smollm2)."),
    config: Path = typer.Option(..., "-c", "--config", help="Pipeline TOML file."),
    output: Path = typer.Option(..., "-o", "--output", help="Artifact directory to write."),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="Allow pytorch_model.bin (loaded with weights_only=True)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output directory."),
    streaming: str = typer.Option("auto", "--streaming", help="auto: one decoder block at a time when the model "
                                  "does not fit in memory; on: always (or say why not); off: never."),
    memory_limit: Optional[str] = typer.Option(None, "--memory-limit", help="Memory the compile may use, e.g. 4GiB "
                                               "(default: the cgroup's limit, else the machine's memory)."),
    as_json: bool = json_option(),
):
    """Compile MODEL through the pipeline in CONFIG into an artifact directory."""
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model, describe_plan
    from compiler.pipeline.memory import parse_size
    from qcompile.cli.report import print_reports

    load_plugins()
    limit = parse_size(memory_limit) if memory_limit is not None else None
    result = compile_model(model, PipelineConfig.from_toml(config), output, allow_pickle, force, streaming, limit)
    reports = [r.to_dict() for r in result.reports]

    def show():
        print_reports(out, reports)
        out.print(describe_plan(result))
        out.print(f"wrote [bold]{result.path}[/bold]")

    emit({"artifact": str(result.path), "passes": reports, "streamed": result.streamed,
          "memory_plan": result.memory.to_dict() | {"limit_bytes": result.limit_bytes}}, as_json, None, show)


@app.command("eval")
def eval_cmd(
    path: str = typer.Argument(..., help="Checkpoint or artifact."),
    corpus: str = typer.Option("pydoc", help="pydoc, a .txt file, a folder of .txt, or FILE.jsonl[:field]."),
    windows: int = typer.Option(16, min=1, help="Number of 512-token evaluation windows."),
    split: str = typer.Option("evaluation", help="evaluation (reported figures) or validation (for choosing settings)."),
    reference: Optional[str] = typer.Option(None, "--reference", help="Compare with this model (checkpoint, artifact) "
                                            "or reference file: llama.cpp's KL-divergence statistics."),
    save_reference: Optional[Path] = typer.Option(None, "--save-reference", dir_okay=False, help="Also write the "
                                                  "reference model's log-probs to this file, to pass as --reference later."),
    plot: Optional[Path] = typer.Option(None, "--plot", dir_okay=False, help="Draw the histogram of per-token KL "
                                        "divergence to this PNG (with --reference)."),
    runtimes: list[str] = typer.Option([], "--runtimes", help="With --reference: a row of statistics for each runtime "
                                       "the artifact lowers to, a comma list of engine, onnx, vllm, gguf, triton."),
    runtime_dir: Optional[Path] = typer.Option(None, "--runtime-dir", file_okay=False, help="With --runtimes: lower "
                                               "into this folder and keep it (default: a temporary one)."),
    as_json: bool = json_option(),
    output_json: Optional[Path] = output_json_option(),
    allow_pickle: bool = typer.Option(False, "--allow-pickle"),
    dtype: str = typer.Option("float32", help="Compute dtype for checkpoints (artifacts keep their own)."),
):
    """Perplexity on the evaluation (or validation) region of a corpus (the shared protocol); with
    --reference, llama.cpp's KL-divergence statistics against a reference model on the same windows."""
    from compiler.io.load import load_checkpoint
    from compiler.pipeline.evaluate import check_reference_options, compare_to_reference, evaluate_perplexity, load_reference
    from qcompile.cli.options import parse_list
    from qcompile.cli.report import print_kl_divergence, print_runtime_kl_divergence
    from qcompile.eval_runtimes import check_runtimes, compare_runtimes

    runtimes = parse_list(runtimes, str, "--runtimes")
    check_reference_options(reference, save_reference, plot)
    if runtimes:
        check_runtimes(runtimes, reference, plot)
        load_plugins()  # the lowerings
    loaded = load_checkpoint(path, dtype, allow_pickle)
    if runtimes:
        result = compare_runtimes(loaded, runtimes, load_reference(reference, dtype, allow_pickle), corpus, windows,
                                  split, save_reference, runtime_dir=runtime_dir)
        emit(result, as_json, output_json, lambda: print_runtime_kl_divergence(out, result))
        if save_reference is not None:
            (err if as_json else out).print(f"wrote {save_reference}")
        return
    if reference is not None:
        ref = load_reference(reference, dtype, allow_pickle)
        result = compare_to_reference(loaded, ref, corpus, windows, split, save_reference, plot)
        emit(result, as_json, output_json, lambda: print_kl_divergence(out, result))
        for written in (save_reference, plot):
            if written is not None:
                (err if as_json else out).print(f"wrote {written}")
        return
    result = evaluate_perplexity(loaded, corpus, windows, split=split)
    summary = {"ppl": result["ppl"], "tokens": result["tokens"], "corpus": corpus, "split": split, "windows": windows}
    emit(summary, as_json, output_json, lambda: out.print(
        f"perplexity [bold]{result['ppl']:.4f}[/bold] over {result['tokens']} tokens ({corpus}, {split} region, "
        f"{windows} windows)"))


@app.command("inspect")
def inspect_cmd(
    artifact: Path = typer.Argument(..., help="Artifact directory."),
    as_json: bool = json_option(),
    output_json: Optional[Path] = output_json_option(),
):
    """Passes, weight formats, per-layer table and size on disk of an artifact."""
    from compiler.io.summary import artifact_summary
    from qcompile.cli.report import print_summary

    summary = artifact_summary(artifact)
    emit(summary, as_json, output_json, lambda: print_summary(out, summary))


@app.command("example")
def example_cmd(
    output: Path = typer.Option(Path("out/example"), "-o", "--output", help="Folder for the example's artifacts."),
    windows: int = typer.Option(16, min=1, help="Evaluation windows per perplexity."),
):
    """The main job end to end on the built-in SmolLM2-135M: compile, evaluate, compare."""
    from qcompile.cli.example import run_example

    load_plugins()
    run_example(out, output, windows)


# Commands with their own modules (imported here so `qcompile --help` lists them).
from qcompile.cli.bench import app as _bench_app  # noqa: E402
from qcompile.cli.distill import distill_cmd  # noqa: E402
from qcompile.cli.generate import generate_cmd  # noqa: E402
from qcompile.cli.lower import lower_cmd  # noqa: E402
from qcompile.cli.serve import serve_cmd  # noqa: E402

app.command("distill")(distill_cmd)
app.command("generate")(generate_cmd)
app.command("lower")(lower_cmd)
app.command("serve")(serve_cmd)
app.add_typer(_bench_app, name="bench")


def main() -> None:
    try:
        app()
    except QCompileError as e:
        if _state["debug"]:
            raise
        err.print(Text.assemble(("error: ", "red"), str(e)), soft_wrap=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except Exception as e:
        if _state["debug"]:
            raise
        err.print(Text.assemble(("internal error: ", "red"), f"{type(e).__name__}: {e} (run with --debug for the traceback)"), soft_wrap=True)
        sys.exit(1)
