"""``qcompile distill``: train a student against a teacher, write it as an artifact with its logs.

    OUT/
      student/         the student artifact (same format as ``qcompile compile``)
      metrics.jsonl    one JSON object per training step
      checkpoints/     full-state training checkpoints (step-NNNNNN/), the newest K
      result.json      the held-out figures (also the last line of ``--json``)
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from compiler.errors import ConfigError


def _load_student(spec: str, teacher):
    """(student model, source info, earlier pipeline, earlier reports) from a path or ``keep_layers:...``."""
    from compiler.io.load import load_checkpoint
    from passes.distill.students import keep_layers_student, parse_keep_layers

    if spec.startswith("keep_layers:"):
        return keep_layers_student(teacher.model, parse_keep_layers(spec, teacher.model.config.n_layers)), teacher.source, {}, []
    loaded = load_checkpoint(spec, "float32")
    manifest = loaded.manifest or {}
    return loaded.model, loaded.source, manifest.get("pipeline", {}), manifest.get("passes", [])


def distill_cmd(
    teacher: str = typer.Option(..., "--teacher", help="Float teacher: HF directory, .gguf, or built-in name (smollm2)."),
    student: str = typer.Option(..., "--student", help="Student checkpoint or artifact (INT4 artifacts train as QAT), or keep_layers:0,2,4 / keep_layers:every2."),
    output: Path = typer.Option(..., "-o", "--output", help="Output folder (student/, metrics.jsonl, checkpoints/)."),
    corpus: str = typer.Option("pydoc", help="Training corpus (calib spec); its evaluation region is held out."),
    train_corpus: list[str] = typer.Option([], "--train-corpus", help="More training text: this corpus's pool (first 70%) is added; repeatable."),
    generated_sequences: int = typer.Option(0, help="Also train on this many sequences the teacher writes from pool prompts."),
    steps: int = typer.Option(100, help="Optimizer steps (0 with --block-epochs: block-wise reconstruction only)."),
    seq_len: int = typer.Option(256, help="Tokens per packed training sequence."),
    batch_size: int = typer.Option(4, help="Sequences per micro-batch, over all ranks."),
    grad_accum: int = typer.Option(1, help="Micro-batches per optimizer step."),
    lr: float = typer.Option(1e-4, help="Peak learning rate (AdamW)."),
    warmup_steps: Optional[int] = typer.Option(None, help="Linear warm-up steps (default steps/20), then cosine."),
    alpha: float = typer.Option(1.0, help="Weight of T²·KL(teacher‖student)."),
    beta: float = typer.Option(0.1, help="Weight of the hidden-state MSE."),
    gamma: float = typer.Option(0.0, help="Weight of the next-token cross-entropy."),
    temperature: float = typer.Option(1.0, help="Softmax temperature of the KL term."),
    hidden_norm: str = typer.Option("rms", help="rms | none: compare hidden states after a per-token RMS normalization, or raw."),
    learn_qparams: bool = typer.Option(False, "--learn-qparams", help="QAT: learn INT4 scales and zero points too."),
    e2e_params: str = typer.Option("all", help="all | scales: what the end-to-end steps train (scales: QAT, INT4 codes fixed, EfficientQAT's E2E-QP)."),
    block_epochs: int = typer.Option(0, help="QAT: block-wise reconstruction first, this many passes per block (0: off)."),
    block_sequences: int = typer.Option(32, help="Training sequences the block-wise reconstruction reads."),
    block_lr: float = typer.Option(1e-3, help="Peak learning rate of the block-wise reconstruction."),
    freeze_embeddings: bool = typer.Option(False, "--freeze-embeddings", help="Do not train embeddings / lm_head."),
    precision: str = typer.Option("auto", help="auto | fp32 | bf16 | fp16 (auto: fp32 on CPU, bf16 on accelerators)."),
    gradient_checkpointing: bool = typer.Option(False, "--gradient-checkpointing", help="Recompute layers in backward to save memory."),
    fsdp: bool = typer.Option(False, "--fsdp", help="Under torchrun, shard with FSDP instead of DDP."),
    checkpoint_every: int = typer.Option(50, help="Steps between checkpoints (0: only the last)."),
    keep_checkpoints: int = typer.Option(2, help="Checkpoints to keep."),
    eval_windows: int = typer.Option(8, help="Held-out windows per corpus."),
    eval_len: int = typer.Option(512, help="Tokens per held-out window."),
    heldout: list[str] = typer.Option([], "--heldout", help="Another corpus to report on (its evaluation region); repeatable."),
    seed: int = typer.Option(0, help="Data order seed."),
    tensorboard: bool = typer.Option(False, "--tensorboard", help="Also log to OUT/tensorboard."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest checkpoint in OUT."),
    force: bool = typer.Option(False, "--force", help="Replace OUT/student if it exists."),
    as_json: bool = typer.Option(False, "--json", help="Print the held-out figures as JSON (last line)."),
):
    """Distill TEACHER into STUDENT on CORPUS; report held-out KL, top-1 agreement and perplexity before/after."""
    from compiler.io.artifact import save_artifact
    from compiler.io.load import load_checkpoint
    from compiler.options import parse_options
    from passes.distill import DistillOptions, run_distillation
    from passes.distill.checkpoint import list_checkpoints
    from passes.distill.distributed import setup_distributed
    from qcompile.cli.console import out

    options = parse_options(DistillOptions, dict(
        teacher=teacher, student=student, corpus=corpus, train_corpora=list(train_corpus),
        generated_sequences=generated_sequences, steps=steps, seq_len=seq_len, batch_size=batch_size,
        grad_accum=grad_accum, lr=lr, warmup_steps=warmup_steps, alpha=alpha, beta=beta, gamma=gamma,
        temperature=temperature, hidden_norm=hidden_norm, learn_qparams=learn_qparams, e2e_params=e2e_params,
        block_epochs=block_epochs, block_sequences=block_sequences, block_lr=block_lr,
        freeze_embeddings=freeze_embeddings, precision=precision,
        gradient_checkpointing=gradient_checkpointing, fsdp=fsdp, checkpoint_every=checkpoint_every,
        keep_checkpoints=keep_checkpoints, eval_windows=eval_windows, eval_len=eval_len, heldout=list(heldout),
        seed=seed, output_dir=str(output), tensorboard=tensorboard), "distill")
    if list_checkpoints(output / "checkpoints") and not resume:
        raise ConfigError(f"{output} already holds training checkpoints; pass --resume to continue, or choose another -o")
    if (output / "student").exists() and not force and not resume:
        raise ConfigError(f"{output / 'student'} already exists; choose another -o or pass --force")
    env = setup_distributed()
    t = load_checkpoint(teacher, "float32")
    if t.tokenizer is None:
        raise ConfigError(f"teacher {teacher}: no tokenizer; distillation reads text through the teacher's tokenizer")
    model, source, pipeline, reports = _load_student(student, t)
    outcome = run_distillation(t.model, model, t.tokenizer, options, output, resume)
    if not env.is_main:
        return
    report = {"name": "distill", "options": options.to_dict(), "wall_time_s": outcome.metrics["train_s"],
              "metrics": outcome.metrics, "layers": [], "notes": [f"teacher {teacher}, student {student}"]}
    pipeline = {**pipeline, "passes": [*pipeline.get("passes", []), {"name": "distill", "teacher": teacher, "student": student}]}
    path = save_artifact(output / "student", model, t.tokenizer, source, pipeline, [*reports, report], force=True)
    result = {**outcome.metrics, "artifact": str(path)}
    (output / "result.json").write_text(json.dumps(result, indent=1))
    if as_json:
        print(json.dumps(result))
    else:
        _print_result(out, result)


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
