"""``DistillOptions``: the options of the ``distill`` pass and of ``qcompile distill``, validated on creation."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from passes.distill.loss import LossWeights

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
HIDDEN_NORMS = ("rms", "none")
E2E_PARAMS = ("all", "scales")


@dataclass
class DistillOptions:
    """Teacher, student, data, loss and loop settings.

    Example (a pipeline file)::

        [[passes]]
        name = "distill"
        teacher = "smollm2"      # the float model; empty: a frozen copy of the model entering the pass
        student = ""             # "" trains the pipeline's model (QAT when it holds Int4Linear);
                                 # "keep_layers:0,2,4" drops layers first
        steps = 200
        seq_len = 256
    """

    teacher: str = ""
    student: str = ""
    corpus: str = "pydoc"
    # More training text: the pool (first 70%) of each of these corpora is added to the training
    # sequences; their evaluation regions stay held out like the main corpus's.
    train_corpora: list[str] = field(default_factory=list)
    # Sequences the teacher writes (sampled from 16-token prompts cut out of the pool), added to the
    # training sequences when the pool is too small (LLM-QAT's data); 0: the pool only.
    generated_sequences: int = 0
    steps: int = 100
    seq_len: int = 256
    batch_size: int = 4  # sequences per micro-batch over all ranks (each rank reads batch_size / world_size)
    grad_accum: int = 1
    lr: float = 1e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int | None = None  # default: steps // 20
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # 0 disables clipping (the norm is still logged)
    alpha: float = 1.0
    beta: float = 0.1
    gamma: float = 0.0
    temperature: float = 1.0
    hidden_norm: Literal["rms", "none"] = "rms"  # MSE of per-token RMS-normalized hidden states ("none": raw)
    layer_map: list[list[int]] | None = None  # [[student_layer, teacher_layer], ...]; default: proportional depth
    learn_qparams: bool = False  # QAT: learn INT4 scales and zero points too (else frozen)
    # What the end-to-end steps train: "all" (every parameter; INT4 weights through the STE) or
    # "scales" (QAT: the INT4 codes fixed, only the scales; EfficientQAT's E2E-QP after Block-AP).
    e2e_params: Literal["all", "scales"] = "all"
    # Block-wise reconstruction first (passes/distill/blockwise.py): each block trained alone to
    # match the teacher's block output, ``block_epochs`` passes over ``block_sequences`` training
    # sequences at ``block_lr``; 0 epochs: off. Needs a student as deep and wide as the teacher.
    block_epochs: int = 0
    block_sequences: int = 32
    block_lr: float = 1e-3
    freeze_embeddings: bool = False
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 on accelerators, fp32 on CPU
    gradient_checkpointing: bool = False
    fsdp: bool = False  # under torchrun: shard with FSDP instead of replicating with DDP
    checkpoint_every: int = 50  # 0: only the final checkpoint
    keep_checkpoints: int = 2
    max_consecutive_skips: int = 10
    seed: int = 0
    eval_windows: int = 8
    eval_len: int = 512
    heldout: list[str] = field(default_factory=list)  # more corpora to report on (their evaluation regions)
    output_dir: str = ""  # metrics.jsonl and checkpoints/ (the pass writes none when empty)
    tensorboard: bool = False

    def __post_init__(self):
        positive = ("seq_len", "batch_size", "grad_accum", "keep_checkpoints", "max_consecutive_skips",
                    "eval_windows", "eval_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.steps < 0 or (self.steps == 0 and not self.block_epochs):
            raise ValueError(f"steps must be >= 1 (or 0 with block_epochs > 0: block-wise reconstruction only), "
                             f"got {self.steps}")
        if self.seq_len < 2 or self.eval_len < 2:
            raise ValueError("seq_len and eval_len must be >= 2 (a next token is predicted)")
        if self.lr <= 0 or self.block_lr <= 0:
            raise ValueError(f"lr and block_lr must be > 0, got {self.lr} and {self.block_lr}")
        if self.corpus in self.train_corpora or len(set(self.train_corpora)) != len(self.train_corpora):
            raise ValueError(f"train_corpora repeats a corpus ({self.train_corpora} beside corpus {self.corpus!r}); name each once")
        if self.generated_sequences < 0:
            raise ValueError(f"generated_sequences must be >= 0, got {self.generated_sequences}")
        if self.block_epochs < 0 or self.block_sequences < 1:
            raise ValueError(f"block_epochs must be >= 0 and block_sequences >= 1, "
                             f"got {self.block_epochs} and {self.block_sequences}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps is None:
            self.warmup_steps = self.steps // 20
        if self.warmup_steps < 0 or (self.warmup_steps and self.warmup_steps >= self.steps):
            raise ValueError(f"warmup_steps must be in [0, steps), got {self.warmup_steps} with steps={self.steps}")
        for name in ("alpha", "beta", "gamma", "weight_decay", "max_grad_norm", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.alpha == self.beta == self.gamma == 0:
            raise ValueError("alpha, beta and gamma are all 0: nothing to train on; set at least one")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.hidden_norm not in HIDDEN_NORMS:
            raise ValueError(f"hidden_norm must be one of {', '.join(HIDDEN_NORMS)}, got {self.hidden_norm!r}")
        if self.e2e_params not in E2E_PARAMS:
            raise ValueError(f"e2e_params must be one of {', '.join(E2E_PARAMS)}, got {self.e2e_params!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.layer_map is not None and not all(len(p) == 2 for p in self.layer_map):
            raise ValueError("layer_map must be a list of [student_layer, teacher_layer] pairs")

    @property
    def loss_weights(self) -> LossWeights:
        return LossWeights(self.alpha, self.beta, self.gamma, self.temperature, self.hidden_norm)

    def to_dict(self) -> dict:
        return asdict(self)
