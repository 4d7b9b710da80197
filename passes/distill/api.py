"""``run_distillation``: held-out comparison, block-wise reconstruction (when asked), training,
re-packing and the comparison again.

Used by the ``distill`` pass and by ``qcompile distill``; returns the figures both report.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from compiler.formats.int4 import Int4Linear
from compiler.model.transformer import Transformer
from passes.distill.blockwise import check_blockwise, reconstruct_blocks
from passes.distill.checkpoint import list_checkpoints
from passes.distill.config import DistillOptions
from passes.distill.data import (
    PackedLoader,
    corpus_tokens,
    heldout_windows,
    pack_sequences,
    teacher_sequences,
)
from passes.distill.errors import DistillConfigError
from passes.distill.evaluate import compare_on_windows, teacher_logits
from passes.distill.students import freeze_codes, make_qat_student, repack_int4
from passes.distill.trainer import (
    Distiller,
    TrainResult,
    set_gradient_checkpointing,
    unshard_student,
)


@dataclass
class DistillOutcome:
    metrics: dict  # kl_before/after, top1_agreement_before/after, perplexities, per held-out corpus;
    # the same on a sample of the training sequences (trained_sample)
    train: TrainResult
    qat_layers: int


def heldout_sets(tokenizer, options: DistillOptions) -> dict[str, torch.Tensor]:
    """The evaluation region of the training corpus, then of each extra ``heldout`` corpus."""
    names = [options.corpus] + [c for c in options.heldout if c != options.corpus]
    return {name: heldout_windows(tokenizer, name, options.eval_windows, options.eval_len) for name in names}


def training_sequences(tokenizer, options: DistillOptions, pool: torch.Tensor) -> torch.Tensor:
    """The packed pool of the training corpus (``pool``), then that of each of ``train_corpora``:
    [n, seq_len]. Every evaluation region stays out."""
    pools = [pool] + [corpus_tokens(tokenizer, c).pool for c in options.train_corpora]
    return torch.cat([pack_sequences(p, options.seq_len) for p in pools])


# The first sequences of the training order, which the block phase and the end-to-end steps both
# read first: their KL beside the held-out KL shows how much of a gain is fitting the training text.
TRAINED_SAMPLE = 16


def _first_in_order(sequences: torch.Tensor, seed: int, n: int) -> torch.Tensor:
    """The first ``n`` sequences of the seeded training order (all of them when fewer)."""
    return PackedLoader(sequences, seed).next_batch(min(n, len(sequences)))


def _summary(before: dict[str, dict], after: dict[str, dict], main: str) -> dict:
    b, a = before[main], after[main]
    return {"kl_before": b["kl"], "kl_after": a["kl"], "top1_agreement_before": b["top1_agreement"],
            "top1_agreement_after": a["top1_agreement"], "ppl_teacher": a["ppl_teacher"],
            "ppl_student_before": b["ppl_student"], "ppl_student_after": a["ppl_student"],
            "heldout": {name: {"before": before[name], "after": after[name]} for name in before}}


def run_distillation(teacher: Transformer, student: Transformer, tokenizer, options: DistillOptions,
                     output_dir: Path | None = None, resume: bool = False,
                     on_step: Callable[[int, dict], None] | None = None) -> DistillOutcome:
    """Distill ``teacher`` into ``student`` (modified in place; INT4 students come back re-packed as INT4)."""
    if options.e2e_params == "scales" and not any(isinstance(m, Int4Linear) for m in student.modules()):
        raise DistillConfigError('e2e_params = "scales" trains INT4 scales, and the student has no INT4 layers; '
                                 'use e2e_params = "all" for a float student')
    if options.block_epochs:
        check_blockwise(teacher, student)
    sets = heldout_sets(tokenizer, options)
    pool = corpus_tokens(tokenizer, options.corpus).pool
    sequences = training_sequences(tokenizer, options, pool)
    if options.generated_sequences:
        written = teacher_sequences(teacher, pool, options.generated_sequences, options.seq_len, options.seed)
        sequences = torch.cat([sequences, written])
    seen = _first_in_order(sequences, options.seed, TRAINED_SAMPLE)
    reference = {name: teacher_logits(teacher, w) for name, w in sets.items()}
    seen_reference = teacher_logits(teacher, seen)

    def evaluate() -> tuple[dict[str, dict], dict]:
        """The student against the teacher on each held-out set, and on the trained-on sample."""
        return ({name: compare_on_windows(teacher, student, w, reference=reference[name]) for name, w in sets.items()},
                compare_on_windows(teacher, student, seen, reference=seen_reference))

    before, seen_before = evaluate()
    qat_layers = make_qat_student(student, options.learn_qparams)
    resuming = resume and output_dir is not None and list_checkpoints(Path(output_dir) / "checkpoints")
    blocks = {}
    if options.block_epochs and not resuming:  # a checkpoint already holds the reconstructed blocks
        first = _first_in_order(sequences, options.seed, options.block_sequences)
        blocks = reconstruct_blocks(teacher, student, first, options.block_epochs, options.block_lr,
                                    options.batch_size, options.max_grad_norm, options.seed)
        main = options.corpus  # what the blocks alone did, before end-to-end training changes it
        blocks["kl_after_blocks"] = compare_on_windows(teacher, student, sets[main], reference=reference[main])["kl"]
    if options.e2e_params == "scales":
        freeze_codes(student)
    distiller = Distiller(teacher, student, sequences, options, output_dir, on_step)
    result = distiller.train(resume)
    unshard_student(distiller)
    set_gradient_checkpointing(student, False)
    repack_int4(student)
    student.eval()
    after, seen_after = evaluate()
    metrics = _summary(before, after, options.corpus)
    metrics["trained_sample"] = {"before": seen_before, "after": seen_after}
    metrics.update({"training_sequences": len(sequences), "steps": result.steps, "skipped_steps": result.skipped,
                    "tokens_trained": result.tokens, "train_s": round(result.wall_s, 2),
                    "tokens_per_s": result.tokens_per_s, "qat_layers": qat_layers,
                    "resumed_from": result.resumed_from, **blocks})
    return DistillOutcome(metrics, result, qat_layers)
