"""Block-wise reconstruction before end-to-end distillation (EfficientQAT's Block-AP, Chen et al. 2024).

Each decoder block of the student, in order, is trained alone to reproduce the teacher block's
output: the student block reads the student's own hidden states (so it also corrects the error
that the blocks before it left), the target is the teacher's hidden state at the same depth, and
the loss is the MSE of the two after each token's RMS normalisation (the next block reads its
input through RMSNorm; raw MSE would be spent on SmolLM2's few massive activations). One block's
forward and backward per step is far cheaper than the whole model's, so many more steps fit in the
same time, and each block's error is fixed where it arises instead of through 30 layers of
gradient. Needs a student as deep and wide as the teacher (a QAT student); runs on the
``block_sequences`` first sequences of the seeded training order, never on held-out text.
"""
from __future__ import annotations

import math
import time

import torch

from compiler.model.transformer import Transformer
from compiler.progress import track
from passes.distill.errors import DistillConfigError
from passes.distill.loss import normalized_mse


def check_blockwise(teacher: Transformer, student: Transformer) -> None:
    t, s = teacher.config, student.config
    if (s.n_layers, s.dim) != (t.n_layers, t.dim):
        raise DistillConfigError(f"block_epochs needs a student as deep and wide as the teacher "
                                 f"({t.n_layers} layers of {t.dim}); this one has {s.n_layers} of {s.dim}: "
                                 "set block_epochs = 0 for a smaller student")


def _hidden_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return normalized_mse(out.float(), target.float())


class _Rope:
    """Positions and rotary tables for a batch of ``n`` sequences of length ``T``."""

    def __init__(self, model: Transformer, n: int, T: int, device, dtype):
        self.positions = torch.arange(T, device=device).expand(n, T)
        self.cos, self.sin = model.rope(self.positions, dtype)

    def run(self, block, x: torch.Tensor) -> torch.Tensor:
        n = len(x)
        return block(x, self.cos[:n], self.sin[:n], self.positions[:n])


@torch.no_grad()
def _map_batches(fn, x: torch.Tensor, batch_size: int) -> torch.Tensor:
    return torch.cat([fn(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])


# The per-block MSE before and after training is a diagnostic: on the first sequences only, so the
# "before" figure costs a small forward pass instead of a third one over every sequence.
MSE_SAMPLE = 64


def reconstruct_blocks(teacher: Transformer, student: Transformer, sequences: torch.Tensor, epochs: int,
                       lr: float, batch_size: int, max_grad_norm: float, seed: int) -> dict:
    """Train each student block on ``sequences`` [N, T] for ``epochs`` passes; returns the
    per-block hidden-state MSE before and after (on the first ``MSE_SAMPLE`` sequences), the
    skipped (non-finite) steps and the wall time."""
    check_blockwise(teacher, student)
    device = next(student.parameters()).device
    ids = sequences.to(device)
    dtype = next(teacher.parameters()).dtype
    rope = _Rope(teacher, batch_size, ids.shape[1], device, dtype)
    with torch.no_grad():
        x_teacher = _map_batches(teacher.embed_tokens, ids, batch_size)
        x_student = _map_batches(student.embed_tokens, ids, batch_size).to(dtype)
    before, after, skipped = [], [], 0
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    pairs = list(zip(teacher.layers, student.layers))
    for t_block, s_block in track(pairs, "distill: block-wise reconstruction", total=len(pairs)):
        target = _map_batches(lambda x: rope.run(t_block, x), x_teacher, batch_size)
        sample_out = _map_batches(lambda x: rope.run(s_block, x), x_student[:MSE_SAMPLE], batch_size)
        before.append(_hidden_mse(sample_out, target[:MSE_SAMPLE]).item())
        skipped += _train_block(s_block, rope, x_student, target, epochs, lr, batch_size, max_grad_norm, gen)
        x_student = _map_batches(lambda x: rope.run(s_block, x), x_student, batch_size)
        after.append(_hidden_mse(x_student[:MSE_SAMPLE], target[:MSE_SAMPLE]).item())
        x_teacher = target
    return {"block_mse_before": before, "block_mse_after": after, "block_skipped_steps": skipped,
            "block_s": round(time.perf_counter() - start, 2)}


def _train_block(block, rope: _Rope, inputs: torch.Tensor, target: torch.Tensor, epochs: int, lr: float,
                 batch_size: int, max_grad_norm: float, gen: torch.Generator) -> int:
    """AdamW with cosine decay to lr/10 over ``epochs`` passes; returns the steps skipped as non-finite."""
    params = [p for p in block.parameters() if p.requires_grad]
    if not params:
        return 0
    steps = epochs * math.ceil(len(inputs) / batch_size)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps, eta_min=lr / 10)
    skipped = 0
    for _ in range(epochs):
        order = torch.randperm(len(inputs), generator=gen).to(inputs.device)
        for i in range(0, len(inputs), batch_size):
            rows = order[i:i + batch_size]
            loss = _hidden_mse(rope.run(block, inputs[rows]), target[rows])
            optimizer.zero_grad(set_to_none=True)
            if not torch.isfinite(loss):
                skipped += 1
            else:
                loss.backward()
                if max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
                optimizer.step()
            schedule.step()
    optimizer.zero_grad(set_to_none=True)
    return skipped
