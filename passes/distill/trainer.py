"""The distillation training loop, shared by the ``distill`` pass and ``qcompile distill``.

AdamW with linear warm-up then cosine decay, gradient accumulation and clipping, bf16 autocast
(fp16 with dynamic loss scaling on accelerators), optional gradient checkpointing, DDP/FSDP under
torchrun. A step whose loss or gradient is not finite changes no weight: it is counted and logged,
and too many in a row stop the run with ``TrainingDivergedError`` (checkpoints are only written
after good steps, so the newest one is good). Checkpoints hold the full state, so a resumed run on
the CPU ends bitwise equal to an uninterrupted one.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from compiler.model.transformer import Transformer, rope_inv_freq
from compiler.progress import make_progress
from passes.distill.checkpoint import (
    list_checkpoints,
    load_checkpoint_dir,
    save_checkpoint,
    set_rng_state,
)
from passes.distill.config import DistillOptions
from passes.distill.data import DataPosition, PackedLoader
from passes.distill.distributed import (
    DistEnv,
    all_mean,
    barrier,
    setup_distributed,
    wrap_for_training,
)
from passes.distill.errors import DistillConfigError, TrainingDivergedError
from passes.distill.loss import HiddenProjections, distill_loss
from passes.distill.students import default_layer_map


class WarmupCosine:
    """LR multiplier: linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``.

    A callable object (not a closure) so ``LambdaLR.state_dict`` records it as plain numbers.
    """

    def __init__(self, warmup: int, total: int, min_ratio: float):
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class StudentWithProjections(nn.Module):
    """The trained module: the student plus, when widths differ, the hidden-state projections.

    ``forward`` returns the logits and the (projected) student hidden states of each mapped pair,
    so every trainable parameter is used inside ``forward`` as DDP expects.
    """

    def __init__(self, student: Transformer, layer_map: list[tuple[int, int]], projections: HiddenProjections | None):
        super().__init__()
        self.student, self.projections = student, projections
        self.student_layers = [s for s, _ in layer_map]

    def forward(self, input_ids: torch.Tensor):
        logits, hidden = self.student(input_ids, return_hidden=True)
        mapped = [hidden[s] for s in self.student_layers]
        if self.projections is not None:
            mapped = [self.projections(i, h.float()) for i, h in enumerate(mapped)]
        return logits, mapped


def set_gradient_checkpointing(model: Transformer, enabled: bool) -> None:
    """Recompute each decoder layer in the backward pass instead of keeping its activations."""
    for layer in model.layers:
        if enabled and "forward" not in layer.__dict__:
            inner = layer.forward
            layer.forward = lambda *args, _f=inner, **kw: checkpoint(_f, *args, use_reentrant=False, **kw)
        elif not enabled:
            layer.__dict__.pop("forward", None)


def resolve_layer_map(options: DistillOptions, student: Transformer, teacher: Transformer) -> list[tuple[int, int]]:
    ls, lt = student.config.n_layers, teacher.config.n_layers
    if options.layer_map is None:
        return default_layer_map(ls, lt)
    pairs = [(int(s), int(t)) for s, t in options.layer_map]
    for s, t in pairs:
        if not (0 <= s < ls and 0 <= t < lt):
            raise DistillConfigError(f"layer_map pair [{s}, {t}] is out of range: the student has {ls} layers, the teacher {lt}")
    return pairs


def check_pair(teacher: Transformer, student: Transformer) -> None:
    """Teacher and student must share a vocabulary (same tokenizer) for the logits to compare."""
    if teacher.config.vocab_size != student.config.vocab_size:
        raise DistillConfigError(f"teacher vocabulary {teacher.config.vocab_size} != student {student.config.vocab_size}; "
                                 "distillation needs a student with the teacher's tokenizer")


@dataclass
class LoopState:
    step: int = 0
    skipped: int = 0
    consecutive_skips: int = 0
    tokens: int = 0


@dataclass
class TrainResult:
    steps: int
    skipped: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    last: dict  # the last step's log record
    resumed_from: int | None = None


def _precision(options: DistillOptions, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for fp32."""
    p = options.precision
    if p == "auto":
        p = "fp32" if device.type == "cpu" else "bf16"
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[p]


class Distiller:
    """One training run: build with the models and packed sequences, then ``train()``.

    ``on_step(step, record)`` is called after each step (tests use it to interrupt a run).
    """

    def __init__(self, teacher: Transformer, student: Transformer, sequences: torch.Tensor, options: DistillOptions,
                 output_dir: Path | None = None, on_step: Callable[[int, dict], None] | None = None):
        check_pair(teacher, student)
        self.options, self.output_dir, self.on_step = options, output_dir, on_step
        self.env: DistEnv = setup_distributed()
        if options.batch_size % self.env.world_size:
            raise DistillConfigError(f"batch_size {options.batch_size} is not a multiple of the {self.env.world_size} ranks; "
                                     "each rank must read an equal share")
        self.device = self.env.device
        self.autocast_dtype = _precision(options, self.device)
        self.teacher = teacher.to(self.device).eval().requires_grad_(False)
        self.student = student.to(self.device).train()
        if options.freeze_embeddings:
            self.student.embed_tokens.requires_grad_(False)
            self.student.lm_head.requires_grad_(False)
        set_gradient_checkpointing(self.student, options.gradient_checkpointing)
        self.layer_map = resolve_layer_map(options, student, teacher) if options.beta else []
        projections = None
        if self.layer_map and student.config.dim != teacher.config.dim:
            projections = HiddenProjections(len(self.layer_map), student.config.dim, teacher.config.dim).to(self.device)
        self.module = StudentWithProjections(self.student, self.layer_map, projections)
        # FSDP turns parameters into shards; keep a meta-device skeleton to rebuild a plain student after.
        self._skeleton = copy.deepcopy(student).to("meta") if options.fsdp and self.env.distributed else None
        self.model = wrap_for_training(self.module, self.env, options.fsdp)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=options.lr, weight_decay=options.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, WarmupCosine(options.warmup_steps, options.steps, options.min_lr_ratio))
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.autocast_dtype == torch.float16)
        self.loader = PackedLoader(sequences, options.seed)
        self.state = LoopState()

    # -- checkpoints ---------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path | None:
        return None if self.output_dir is None else self.output_dir / "checkpoints"

    def _full_state(self) -> tuple[dict, dict]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
        )

        return get_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save(self) -> Path | None:
        if self.checkpoint_root is None:
            return None
        model_state, optim_state = self._full_state()
        path = None
        if self.env.is_main:
            s = self.state
            state = {"skipped": s.skipped, "consecutive_skips": s.consecutive_skips, "tokens": s.tokens,
                     "position": self.loader.position.to_dict(), "scheduler": self.scheduler.state_dict(),
                     "scaler": self.scaler.state_dict(), "options": self.options.to_dict(), "world_size": self.env.world_size}
            path = save_checkpoint(self.checkpoint_root, s.step, model_state, optim_state, state, self.options.keep_checkpoints)
        barrier(self.env)
        return path

    def resume(self) -> int | None:
        """Restore the newest checkpoint under ``output_dir``; returns its step (None when there is none)."""
        found = list_checkpoints(self.checkpoint_root) if self.checkpoint_root else []
        if not found:
            return None
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_state_dict,
        )

        model_state, optim_state, meta, rng = load_checkpoint_dir(found[-1])
        self._check_resumable(meta, found[-1])
        set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                       options=StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict(meta["scheduler"])
        if meta["scaler"]:
            self.scaler.load_state_dict(meta["scaler"])
        pos = meta["position"]
        self.state = LoopState(meta["step"], meta["skipped"], meta["consecutive_skips"], meta["tokens"])
        self.loader.position = DataPosition(pos["epoch"], pos["cursor"])
        set_rng_state(meta["rng"], rng)
        return meta["step"]

    def _check_resumable(self, meta: dict, path: Path) -> None:
        # Settings that change what the remaining steps compute must match; eval/log settings may differ.
        same = ("corpus", "train_corpora", "generated_sequences", "seq_len", "batch_size", "grad_accum", "lr",
                "min_lr_ratio", "warmup_steps", "steps", "alpha", "beta", "gamma", "temperature", "hidden_norm", "seed",
                "learn_qparams", "e2e_params", "precision")
        old, new = meta["options"], self.options.to_dict()
        old = {**DistillOptions().to_dict(), **old}  # a setting added since the checkpoint: its default
        changed = [k for k in same if old.get(k) != new.get(k)]
        if changed:
            raise DistillConfigError(f"cannot resume from {path}: {', '.join(f'{k} was {old.get(k)!r}, now {new.get(k)!r}' for k in changed)}; "
                                     "rerun with the original settings or use a new output directory")

    # -- one step ------------------------------------------------------------------------------
    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _micro_step(self, batch: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
        with torch.no_grad(), self._autocast():
            t_logits, t_hidden = self.teacher(batch, return_hidden=True)
        with self._autocast():
            s_logits, s_mapped = self.model(batch)
            pairs = [(i, t) for i, (_, t) in enumerate(self.layer_map)]
            terms = distill_loss(self.options.loss_weights, batch, t_logits, s_logits, t_hidden, s_mapped, pairs)
        self.scaler.scale(terms["loss"] * scale).backward()
        return {k: v.detach() for k, v in terms.items()}

    def step(self) -> dict:
        o, env = self.options, self.env
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        local = o.batch_size // env.world_size
        sums: dict[str, torch.Tensor] = {}
        for micro in range(o.grad_accum):
            batch = self.loader.next_batch(o.batch_size)[env.rank * local:(env.rank + 1) * local].to(self.device)
            sync = micro == o.grad_accum - 1 or not hasattr(self.model, "no_sync")
            with contextlib.nullcontext() if sync else self.model.no_sync():
                terms = self._micro_step(batch, 1.0 / o.grad_accum)
            for k, v in terms.items():
                sums[k] = sums.get(k, 0) + v / o.grad_accum
        self.scaler.unscale_(self.optimizer)
        max_norm = o.max_grad_norm if o.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2 returns a DTensor
            grad_norm = grad_norm.full_tensor()
        logged = {k: all_mean(v.float(), env).item() for k, v in sums.items()}
        finite = math.isfinite(logged["loss"]) and math.isfinite(float(grad_norm))
        lr = self.optimizer.param_groups[0]["lr"]
        if finite:
            self.scaler.step(self.optimizer)
            self.state.consecutive_skips = 0
        else:
            self.state.skipped += 1
            self.state.consecutive_skips += 1
        self.scaler.update()
        self.scheduler.step()
        self.state.step += 1
        tokens = o.batch_size * o.grad_accum * o.seq_len
        self.state.tokens += tokens
        elapsed = time.perf_counter() - start
        record = {"step": self.state.step, **logged, "lr": lr, "grad_norm": float(grad_norm), "skipped": not finite,
                  "skipped_total": self.state.skipped, "tokens_per_s": tokens / elapsed, "step_s": elapsed}
        if self.scaler.is_enabled():
            record["loss_scale"] = self.scaler.get_scale()
        return record

    # -- the loop ------------------------------------------------------------------------------
    def train(self, resume: bool = False) -> TrainResult:
        o = self.options
        resumed_from = self.resume() if resume else None
        logger = StepLogger(self.output_dir, self.env.is_main, o.tensorboard, resumed_from or 0)
        start, first_step, record = time.perf_counter(), self.state.step, {}
        try:
            with make_progress() as progress:
                task = progress.add_task("distill", total=o.steps, completed=self.state.step)
                while self.state.step < o.steps:
                    record = self.step()
                    logger.log(record)
                    progress.update(task, completed=self.state.step,
                                    description=f"distill loss {record['loss']:.4f}" + (" (skipped)" if record["skipped"] else ""))
                    if self.state.consecutive_skips > o.max_consecutive_skips:
                        raise TrainingDivergedError(
                            f"{self.state.consecutive_skips} steps in a row had a non-finite loss or gradient (at step {self.state.step}); "
                            f"stopped, the last good checkpoint is kept. Lower lr (now {o.lr}) or use precision=fp32")
                    good = not record["skipped"]
                    if good and o.checkpoint_every and self.state.step % o.checkpoint_every == 0 and self.state.step < o.steps:
                        self.save()
                    if self.on_step:
                        self.on_step(self.state.step, record)
            if self.state.step > first_step and self.state.consecutive_skips == 0:
                self.save()
        finally:
            logger.close()
        wall = time.perf_counter() - start
        done = (self.state.step - first_step) * o.batch_size * o.grad_accum * o.seq_len
        return TrainResult(self.state.step, self.state.skipped, self.state.tokens, wall, done / wall if wall else 0.0,
                           record, resumed_from)


def unshard_student(distiller: "Distiller") -> Transformer:
    """After FSDP training: gather the full weights into the student's own (unsharded) modules, in place."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    student = distiller.student
    if distiller._skeleton is None:
        return student
    full = get_model_state_dict(distiller.model, options=StateDictOptions(full_state_dict=True))
    plain = distiller._skeleton
    plain.load_state_dict({k.removeprefix("student."): v for k, v in full.items() if k.startswith("student.")}, assign=True)
    if plain.config.tie_embeddings:
        plain.lm_head.weight = plain.embed_tokens.weight
    for name, child in plain.named_children():
        setattr(student, name, child)
    student.inv_freq = rope_inv_freq(student.config).to(distiller.device)
    return student


class StepLogger:
    """metrics.jsonl (one JSON object per step) and, when asked, TensorBoard scalars; rank 0 only.

    On resume, records past the checkpoint's step (written after it, then lost) are dropped first
    so the file reads as one uninterrupted run.
    """

    def __init__(self, output_dir: Path | None, enabled: bool, tensorboard: bool, resumed_step: int):
        self.file = self.writer = None
        if output_dir is None or not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        path = output_dir / "metrics.jsonl"
        kept = []
        if resumed_step and path.exists():
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= resumed_step]
        path.write_text("".join(line + "\n" for line in kept))
        self.file = path.open("a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise DistillConfigError("tensorboard logging needs the tensorboard package: pip install tensorboard") from None
            self.writer = SummaryWriter(str(output_dir / "tensorboard"))

    def log(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.writer:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.writer.add_scalar(f"distill/{k}", v, record["step"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.writer:
            self.writer.close()
