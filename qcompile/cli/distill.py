"""``qcompile distill``: train a student against a teacher, write it as an artifact with its logs.

A front end of the ``distill`` pass (``passes/distill``): it loads the student as the model of a
one-pass pipeline and compiles it like ``qcompile compile`` does (the pipeline is validated, the
target checked, the artifact written by the same code), so the pipeline file

    [[passes]]
    name = "distill"
    teacher = "smollm2"
    steps = 200

run by ``qcompile compile STUDENT -c FILE`` does the same. Every ``DistillOptions`` field is a flag.

    OUT/
      student/         the student artifact (its manifest keeps an artifact student's earlier passes)
      metrics.jsonl    one JSON object per training step
      checkpoints/     full-state training checkpoints (step-NNNNNN/), the newest K
      result.json      the held-out figures (also what --json prints)
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from compiler.errors import ConfigError
from passes.distill.config import DistillOptions
from qcompile.cli.options import add_flags, dataclass_flags, emit, json_option

KEEP_LAYERS = "keep_layers:"


@add_flags(dataclass_flags(DistillOptions, exclude=("teacher", "student", "output_dir")))
def distill_cmd(
    teacher: str = typer.Option(..., "--teacher", help="Float teacher: HF directory, .gguf, or built-in name (smollm2)."),
    student: str = typer.Option(..., "--student", help="Student checkpoint or artifact (INT4 artifacts train as QAT), or keep_layers:0,2,4 / keep_layers:every2 (layers of the teacher)."),
    output: Path = typer.Option(..., "-o", "--output", help="Output folder (student/, metrics.jsonl, checkpoints/, result.json)."),
    target: Optional[str] = typer.Option(None, "--target", help="Check the student's formats against this deployment target (onnx, triton, vllm, gguf, ascend) before training."),
    force: bool = typer.Option(False, "--force", help="Replace OUT/student if it exists."),
    as_json: bool = json_option(),
    *,
    options: dict,
):
    """Distill TEACHER into STUDENT on CORPUS; report held-out KL, top-1 agreement and perplexity before/after."""
    from compiler.io.atomic import atomic_write_text
    from compiler.pipeline import Pipeline
    from compiler.pipeline.compile import compile_loaded
    from passes.distill.distributed import setup_distributed
    from qcompile import load_plugins
    from qcompile.cli.console import out

    load_plugins()
    pipeline = Pipeline(distill_pipeline(teacher, student, output, target, options))  # options parsed before the (slow) loads
    if (output / "student").exists() and not force and not options["resume"]:
        raise ConfigError(f"{output / 'student'} already exists; choose another -o or pass --force")
    env = setup_distributed()
    result = compile_loaded(load_student(student, teacher), pipeline, output / "student", force=True)
    if not env.is_main:
        return
    figures = {**result.reports[-1].metrics, "artifact": str(result.path)}
    atomic_write_text(output / "result.json", json.dumps(figures, indent=1))
    emit(figures, as_json, None, lambda: _print_result(out, figures))


def distill_pipeline(teacher: str, student: str, output: Path, target: str | None, options: dict):
    """The one-pass pipeline ``qcompile distill`` runs. A ``keep_layers`` student is the teacher
    with layers dropped by the pass, which then distills from a frozen copy of the teacher as it
    entered (``teacher = ""``); any other student is the model and ``teacher`` is loaded by the pass."""
    from compiler.pipeline import PipelineConfig

    pass_student, pass_teacher = (student, "") if student.startswith(KEEP_LAYERS) else ("", teacher)
    entry = {"name": "distill", "teacher": pass_teacher, "student": pass_student, "output_dir": str(output), **options}
    return PipelineConfig.from_dict({"target": {"name": target}, "passes": [entry]} if target else {"passes": [entry]})


def load_student(student: str, teacher: str):
    """The pipeline's model: the student checkpoint or artifact, or (``keep_layers``) the float teacher."""
    from compiler.io.load import load_checkpoint
    from passes.distill import check_float_teacher

    if not student.startswith(KEEP_LAYERS):
        return load_checkpoint(student, "float32")
    loaded = load_checkpoint(teacher, "float32")
    check_float_teacher(loaded.model, teacher)
    return loaded


def _print_result(console, r: dict) -> None:
    from rich.table import Table

    table = Table(title=f"distill: {r['steps']} steps, {r['tokens_trained']} tokens, {r['tokens_per_s']:.0f} tokens/s, {r['skipped_steps']} skipped")
    for col in ("held-out corpus", "KL before", "KL after", "top-1 before", "top-1 after", "ppl teacher", "ppl before", "ppl after"):
        table.add_column(col, justify="left" if col == "held-out corpus" else "right")
    rows = {**r["heldout"], "train sample": r["trained_sample"]}
    for name, d in rows.items():
        b, a = d["before"], d["after"]
        table.add_row(name, f"{b['kl']:.4f}", f"{a['kl']:.4f}", f"{b['top1_agreement']:.3f}", f"{a['top1_agreement']:.3f}",
                      f"{a['ppl_teacher']:.3f}", f"{b['ppl_student']:.3f}", f"{a['ppl_student']:.3f}")
    console.print(table)
    console.print(f"wrote [bold]{r['artifact']}[/bold]")
