"""``DistillOptions``: the options of the ``distill`` pass, validated on creation. ``qcompile distill``
builds its flags from these fields (each ``option``'s help text is the flag's)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from compiler.options import option
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

    teacher: str = option("", "Float teacher: HF directory, .gguf or built-in name (smollm2); empty: a frozen "
                                "copy of the model entering the pass.")
    student: str = option("", "Empty: train the pipeline's model (QAT when it holds Int4Linear); "
                              "keep_layers:0,2,4 or keep_layers:every2: drop layers first.")
    corpus: str = option("pydoc", "Training corpus (calib spec); its evaluation region is held out.")
    train_corpora: list[str] = option(
        help="More training text: the pool (first 70%) of each of these corpora is added; their evaluation "
             "regions stay held out.", default_factory=list, flag="--train-corpus")
    generated_sequences: int = option(0, "Also train on this many sequences the teacher writes from 16-token "
                                         "pool prompts (LLM-QAT's data; 0: the pool only).")
    steps: int = option(100, "Optimizer steps (0 with block_epochs: block-wise reconstruction only).")
    seq_len: int = option(256, "Tokens per packed training sequence.")
    batch_size: int = option(4, "Sequences per micro-batch over all ranks (each rank reads batch_size / world_size).")
    grad_accum: int = option(1, "Micro-batches per optimizer step.")
    lr: float = option(1e-4, "Peak learning rate (AdamW).")
    min_lr_ratio: float = option(0.1, "The cosine schedule decays to lr * min_lr_ratio.")
    warmup_steps: int | None = option(None, "Linear warm-up steps, then cosine (default: steps // 20).")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    max_grad_norm: float = option(1.0, "Gradient clipping norm (0: no clipping; the norm is still logged).")
    alpha: float = option(1.0, "Weight of T²·KL(teacher‖student).")
    beta: float = option(0.1, "Weight of the hidden-state MSE.")
    gamma: float = option(0.0, "Weight of the next-token cross-entropy.")
    temperature: float = option(1.0, "Softmax temperature of the KL term.")
    hidden_norm: Literal["rms", "none"] = option("rms", "Compare hidden states after a per-token RMS "
                                                        "normalization (rms), or raw (none).")
    layer_map: list[list[int]] | None = option(None, "[[student_layer, teacher_layer], ...] for the hidden-state "
                                                     "MSE (default: proportional depth); pipeline files only.",
                                               cli=False)
    learn_qparams: bool = option(False, "QAT: learn INT4 scales and zero points too (else frozen).")
    e2e_params: Literal["all", "scales"] = option(
        "all", "What the end-to-end steps train: all (every parameter; INT4 weights through the STE) or scales "
               "(QAT: INT4 codes fixed, only the scales; EfficientQAT's E2E-QP).")
    block_epochs: int = option(0, "QAT: block-wise reconstruction first (passes/distill/blockwise.py), this many "
                                  "passes per block (0: off); needs a student as deep and wide as the teacher.")
    block_sequences: int = option(32, "Training sequences the block-wise reconstruction reads.")
    block_lr: float = option(1e-3, "Peak learning rate of the block-wise reconstruction.")
    freeze_embeddings: bool = option(False, "Do not train embeddings / lm_head.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = option("auto", "auto: fp32 on CPU, bf16 on accelerators.")
    gradient_checkpointing: bool = option(False, "Recompute layers in backward to save memory.")
    fsdp: bool = option(False, "Under torchrun, shard the student with FSDP instead of replicating it with DDP.")
    checkpoint_every: int = option(50, "Steps between training checkpoints (0: only the last).")
    keep_checkpoints: int = option(2, "Training checkpoints to keep (the newest).")
    max_consecutive_skips: int = option(10, "Steps in a row with a non-finite loss or gradient before training "
                                            "stops with an error.")
    seed: int = option(0, "Data order seed.")
    eval_windows: int = option(8, "Held-out windows per corpus.")
    eval_len: int = option(512, "Tokens per held-out window.")
    heldout: list[str] = option(help="More corpora to report on (their evaluation regions).", default_factory=list)
    output_dir: str = option("", "Folder for metrics.jsonl and checkpoints/ (none written when empty).")
    resume: bool = option(False, "Continue from the newest training checkpoint under output_dir.")
    tensorboard: bool = option(False, "Also log to output_dir/tensorboard.")

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
