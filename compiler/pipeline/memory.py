"""Memory planning before any work: the peak a compile will reach, against the memory it may use.

The estimate adds up, in bytes:

    runtime                 the interpreter, torch and the tokenizer (a measured constant)
    weights                 in memory: the whole model; streamed: embeddings, final norm, lm_head
                            and two decoder blocks (the block being converted, and its output)
    <the passes' terms>     what each pass says it needs beyond the weights (``Pass.working_memory``):
                            calibration activations (samples × seq_len × hidden, in and out), one
                            chunk's block forward, Gram / Hessian matrices, search copies, ...

Passes run one after another, so the peak is the weights plus the largest pass. A compile whose
estimate exceeds the limit stops with one line naming the estimate, the limit and what to lower.
The limit is ``--memory-limit`` or, by default, what the machine allows: the cgroup's memory
limit where one is set, else the physical memory. ``benchmarks/streaming_memory.py`` measures the
estimate against peak RSS.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compiler.errors import ConfigError
from compiler.model.config import ModelConfig
from compiler.model.transformer import Transformer

# The interpreter, torch, transformers, a tokenizer and a calibration corpus: 440 MiB measured for
# a float compile, 490 MiB for the smallest AWQ one (benchmarks/streaming_memory.py).
RUNTIME_BYTES = 512 * 2**20
GiB = 2**30
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


class MemoryPlanError(ConfigError):
    """A compile whose estimated peak memory exceeds the limit: found before any work."""


def parse_size(text: str) -> int:
    """'4GiB', '512MB', '2g', '1073741824' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"memory size {text!r}: give a number with a unit, e.g. 4GiB, 512MiB or 16GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 4 else f"{n / 2**20:.0f} MiB"


def _cgroup_limit() -> int | None:
    """This process's cgroup memory limit (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``), if any."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, where = line.split(":", 2)
        if controllers == "":
            candidates = [Path("/sys/fs/cgroup") / where.lstrip("/") / "memory.max"]
        elif "memory" in controllers.split(","):
            candidates = [Path("/sys/fs/cgroup/memory") / where.lstrip("/") / "memory.limit_in_bytes"]
        else:
            continue
        for c in candidates:
            try:
                value = c.read_text().strip()
            except OSError:
                continue
            if value.isdigit() and int(value) < 2**60:  # v1 writes "no limit" as a huge number
                limits.append(int(value))
    return min(limits) if limits else None


def machine_limit() -> int:
    """What this process may use: the cgroup's limit where one is set, else the physical memory."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cgroup = _cgroup_limit()
    return min(physical, cgroup) if cgroup else physical


def block_bytes(model: Transformer, dtype_bytes: int) -> tuple[int, int, int]:
    """(all weights, the largest decoder block, embeddings + final norm + lm_head) in bytes of
    ``model`` (on the meta device: its shapes are what count)."""
    unique = {id(p): p for p in model.parameters()}  # tied embeddings count once
    total = sum(p.numel() for p in unique.values()) * dtype_bytes
    largest = max(sum(p.numel() for p in layer.parameters()) for layer in model.layers) * dtype_bytes
    head = total - sum(sum(p.numel() for p in layer.parameters()) for layer in model.layers) * dtype_bytes
    return total, largest, head


@dataclass
class MemoryPlan:
    """The estimated peak of one compile, by what it holds."""

    streamed: bool
    weights: dict[str, int]
    passes: dict[str, dict[str, int]] = field(default_factory=dict)  # pass -> its terms

    @property
    def peak_pass(self) -> tuple[str | None, dict[str, int]]:
        if not self.passes:
            return None, {}
        return max(self.passes.items(), key=lambda kv: sum(kv[1].values()))

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + sum(self.peak_pass[1].values())

    def terms(self) -> dict[str, int]:
        """Every term of the peak, largest first."""
        name, terms = self.peak_pass
        merged = {**self.weights, **{f"{name}: {k}": v for k, v in terms.items()}}
        return dict(sorted(merged.items(), key=lambda kv: -kv[1]))

    def describe(self) -> str:
        return ", ".join(f"{k} {format_size(v)}" for k, v in list(self.terms().items())[:4])

    def to_dict(self) -> dict:
        return {"streamed": self.streamed, "total_bytes": self.total, "terms": self.terms()}


def plan_memory(passes: list, model: Transformer, calibration, dtype: torch.dtype, streamed: bool) -> MemoryPlan:
    """The estimated peak of running ``passes`` on ``model`` (on the meta device; see the module docstring)."""
    b = torch.empty(0, dtype=dtype).element_size()
    total, largest, head = block_bytes(model, b)
    if streamed:
        weights = {"runtime": RUNTIME_BYTES, "embeddings, norm, lm_head": head, "two decoder blocks": 2 * largest}
    else:
        weights = {"runtime": RUNTIME_BYTES, "model weights": total}
    plan = MemoryPlan(streamed, weights)
    names = [p.name for p in passes]
    for i, p in enumerate(passes):
        label = p.name if names.count(p.name) == 1 else f"passes[{i}] ({p.name})"
        plan.passes[label] = p.working_memory(model, calibration, b, streamed)
    return plan


def check_fits(plan: MemoryPlan, limit: int, calibration, cannot_stream: str | None = None) -> None:
    """Raise ``MemoryPlanError`` (one line) when the plan's peak exceeds ``limit``; an in-memory
    plan's error suggests streaming unless ``cannot_stream`` says why that is not possible."""
    if plan.total <= limit:
        return
    fixes = []
    if any(k.endswith("activations") for k in plan.terms()):
        fixes.append(f"lower [calibration] samples ({calibration.samples}) or seq_len ({calibration.seq_len})")
    if not plan.streamed and cannot_stream is None:
        fixes.append("compile streamed (--streaming on)")
    fixes.append("raise --memory-limit")
    why = f" (it cannot stream: {cannot_stream})" if not plan.streamed and cannot_stream else ""
    raise MemoryPlanError(f"this compile needs about {format_size(plan.total)} ({plan.describe()}), more than the "
                          f"memory limit of {format_size(limit)}{why}; {', or '.join(fixes)}")


def activation_terms(config: ModelConfig, samples: int, seq_len: int, batch: int, dtype_bytes: int) -> dict[str, int]:
    """What a block-by-block calibration holds besides its statistics: every sequence's hidden
    state into and out of the block, and one chunk of ``batch`` sequences through the block
    (its widest activations in float32, and the attention scores)."""
    hidden = samples * seq_len * config.dim * dtype_bytes
    width = max(config.intermediate_size, config.moe_intermediate_size * max(config.num_experts_per_tok, 1))
    chunk = min(batch, samples) * seq_len
    forward = chunk * (3 * width + 6 * config.dim) * 4 + chunk * config.n_heads * seq_len * 4
    return {"calibration activations": 2 * hidden, "block forward": forward}


def converted_weights(model: Transformer, bytes_per_weight: float) -> int:
    """What an in-memory compile holds beside the float model by its end: every block's converted
    weights (the float ones stay mapped from the checkpoint until the compile ends)."""
    return int(model.config.n_layers * block_bytes(model, 1)[1] * bytes_per_weight)


def linear_inputs(config: ModelConfig) -> list[int]:
    """The input widths of one dense decoder block's distinct linear inputs (q/k/v share one, gate/up one)."""
    return [config.dim, config.n_heads * config.head_dim, config.dim, config.intermediate_size]
