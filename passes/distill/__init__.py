"""Teacher–student distillation (issue 8): the ``distill`` pass, its training loop and losses.

The pass trains the pipeline's model against a teacher: after an INT4 pass (RTN or AWQ) that is
quantization-aware training (fake quantization + STE on float master weights, re-packed to the same
INT4 format); with ``student = "keep_layers:..."`` the model first loses layers. ``qcompile distill``
is a front end of this pass: it loads the student as the pipeline's model and runs a one-pass
pipeline through the same validate/run/save path as ``qcompile compile``.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from compiler.formats.qlinear import quantized_modules
from compiler.pipeline import Pass, PassContext, PassReport, register_pass
from compiler.pipeline.memory import block_bytes
from passes.distill.api import run_distillation
from passes.distill.checkpoint import list_checkpoints
from passes.distill.config import DistillOptions
from passes.distill.errors import DistillConfigError
from passes.distill.students import drop_layers, parse_keep_layers

__all__ = ["DistillPass", "DistillOptions", "check_float_teacher", "run_distillation"]


def check_float_teacher(model: torch.nn.Module, spec: str) -> None:
    """A teacher must be the float model: a quantized one is an error naming ``spec``."""
    if quantized_modules(model):
        raise DistillConfigError(f"teacher {spec!r} holds quantized layers; give the float checkpoint as the teacher")


def load_teacher(spec: str):
    """The float teacher model from a checkpoint path or built-in name."""
    from compiler.io.load import load_checkpoint

    loaded = load_checkpoint(spec, "float32")
    check_float_teacher(loaded.model, spec)
    return loaded.model


@register_pass
class DistillPass(Pass):
    """Distill a teacher into the pipeline's model (QAT for INT4 models, or a layer-dropped student).

    Phases: held-out KL/top-1 before; with ``block_epochs``, block-wise reconstruction
    (``passes.distill.blockwise``); training (see ``passes.distill.trainer``); re-packing of the
    fake-quantized layers; held-out KL/top-1 after. The figures land in the pass report.
    """

    name = "distill"
    Options = DistillOptions
    provides = frozenset({"distilled"})

    def check(self, model) -> None:
        s = self.options.student
        if s and not s.startswith("keep_layers:"):
            raise DistillConfigError(f"student {s!r}: the pass trains the pipeline's model; use \"\" or \"keep_layers:...\" "
                                     "(to start from another checkpoint, use 'qcompile distill --student')")
        if s:
            parse_keep_layers(s, model.config.n_layers)
        if s and self.options.block_epochs:
            raise DistillConfigError("block_epochs needs a student as deep as the teacher, and keep_layers drops "
                                     "layers; set block_epochs = 0 for this student")
        out = self.options.output_dir
        if out and list_checkpoints(Path(out) / "checkpoints") and not self.options.resume:
            raise DistillConfigError(f"{out} already holds training checkpoints; set resume = true (--resume) to "
                                     "continue, or choose another output_dir (-o)")

    def working_memory(self, model, calibration, dtype_bytes, streamed) -> dict[str, int]:
        # The whole model trains end to end (scope "model"): a float32 teacher, the gradients and
        # Adam's two moments of every parameter, and the logits of a batch (teacher, student, loss).
        weights = block_bytes(model, 4)[0]
        tokens = self.options.batch_size * self.options.seq_len
        return {"teacher (float32)": weights, "gradients and optimizer state": 3 * weights,
                "logits of a batch": 4 * tokens * model.config.vocab_size * 4}

    def run(self, model: torch.nn.Module, context: PassContext) -> PassReport:
        o = self.options
        if context.tokenizer is None:
            raise DistillConfigError("distillation needs a tokenizer, and this checkpoint ships none")
        if o.teacher:
            teacher = load_teacher(o.teacher)
        elif quantized_modules(model):
            raise DistillConfigError("the model entering distill is quantized; set teacher = \"PATH\" to its float checkpoint")
        else:
            teacher = copy.deepcopy(model).eval()
        if o.student:
            drop_layers(model, parse_keep_layers(o.student, model.config.n_layers))
        outcome = run_distillation(teacher, model, context.tokenizer, o, Path(o.output_dir) if o.output_dir else None,
                                   o.resume)
        notes = [f"teacher: {o.teacher or 'a frozen copy of the model entering the pass'}; "
                 f"student: {'QAT of %d INT4 layers' % outcome.qat_layers if outcome.qat_layers else 'float'}"
                 f"{', layers ' + o.student.removeprefix('keep_layers:') if o.student else ''}"]
        return PassReport(self.name, metrics=outcome.metrics, notes=notes)
