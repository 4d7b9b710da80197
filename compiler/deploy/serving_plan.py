"""The serving plan: how the paged KV cache and the engine's batches are sized.

The ``paged_kv`` pass validates it and records it in the artifact as ``manifest["serving"]``;
``serving.Engine`` reads it back (defaults when absent). It lives in ``compiler/`` because both
``passes/`` and ``serving/`` use it and neither may import the other.

    [[passes]]
    name = "paged_kv"
    block_size = 16
    kv_memory_mb = 256      # or num_blocks = 1024
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Literal

import torch

from compiler.errors import ConfigError

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "float8_e4m3fn": torch.float8_e4m3fn, "int8": torch.int8}
# The cache dtypes that store codes with calibrated scales, and the pass that calibrates them.
SCALED_KV_DTYPES = {"float8_e4m3fn": "fp8", "int8": "int8"}

INT4_COMPUTES = ("auto", "w4a16", "w4a8")


@dataclass(frozen=True)
class ServingPlan:
    """Paged-KV and batching settings. ``kv_dtype="auto"``: the model's dtype, or the FP8 E4M3 or
    INT8 cache the artifact declares (``manifest["kv_cache"]``: ``resolve_kv_dtype``).
    ``num_blocks``, when set, wins over ``kv_memory_mb``.
    ``fuse_projections``: the engine runs q/k/v and gate/up as one matmul each (``compiler/model/fusion.py``).
    ``pack_cpu_weights``: on the CPU, float32 linear layers also keep a packed copy of their weight
    for qcompile's dense kernel or oneDNN (``compiler/kernels/dense_cpu.py``: 4 bytes a weight more).
    ``int4_compute``: how INT4 layers compute: "w4a16", the format's numerics (float activations),
    "w4a8", int8 activations per group and integer dot products (``compiler/kernels/w4a8_cpu.py``,
    a CPU kernel: the activations rounded to int8 as llama.cpp and ONNX Runtime's MatMulNBits at its
    default accuracy_level 4 do, for +0.05% perplexity on SmolLM2 and 1.5-2.3x W4A16's speed), or
    "auto" (the default), W4A8 on a CPU that runs it and W4A16 elsewhere
    (``compiler/kernels/dispatch.resolve_int4_compute``; the engine reports what it chose)."""

    block_size: int = 16
    kv_dtype: Literal["auto", "float32", "bfloat16", "float16", "float8_e4m3fn", "int8"] = "auto"
    num_blocks: int | None = None
    kv_memory_mb: float = 256.0
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    fuse_projections: bool = True
    pack_cpu_weights: bool = True
    int4_compute: Literal["auto", "w4a16", "w4a8"] = "auto"
    version: int = 1

    def __post_init__(self):
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_memory_mb <= 0:
            raise ValueError(f"kv_memory_mb must be > 0, got {self.kv_memory_mb}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.int4_compute not in INT4_COMPUTES:
            raise ValueError(f"int4_compute must be one of {', '.join(INT4_COMPUTES)}, got {self.int4_compute!r}")
        if self.version != 1:
            raise ValueError(f"serving plan version {self.version} is not supported (this qcompile writes 1); recompile")

    def to_dict(self) -> dict:
        return asdict(self)

    def resolved(self, kv: "KVCachePlan") -> "ServingPlan":
        """This plan with ``kv``'s dtype and block count written in: what the manifest records."""
        return replace(self, kv_dtype=kv.kv_dtype, num_blocks=kv.num_blocks)

    @classmethod
    def from_dict(cls, d: dict | None) -> "ServingPlan":
        """From a manifest entry; keys this version does not know (e.g. derived figures) are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in known})


def resolve_kv_dtype(kv_dtype: str, model_dtype: str, kv_cache: dict | None) -> str:
    """The ``KV_DTYPES`` name the paged cache stores K/V in, for a plan's ``kv_dtype`` and the artifact's
    ``kv_cache`` entry. "auto": the entry's dtype where the paged cache holds it (FP8 E4M3 or INT8,
    codes with the entry's scales), else the model dtype; there an E5M2 entry's K/V (or any entry's,
    under a float ``kv_dtype``) are rounded by the model's own ``kv_quant`` hook before the cache
    stores them: the same values, without the memory saving. An FP8 or INT8 cache needs the entry's
    scales for its dtype."""
    declared = (kv_cache or {}).get("dtype")
    name = kv_dtype if kv_dtype != "auto" else declared if declared in KV_DTYPES else model_dtype
    if name not in KV_DTYPES:
        raise ConfigError(f"KV-cache dtype {name!r} is not supported; use one of {', '.join(KV_DTYPES)}")
    if name in SCALED_KV_DTYPES and declared != name:
        has = f"'s KV cache is {declared}" if declared else " has no KV-cache scales"
        raise ConfigError(f"kv_dtype {name} needs K/V scales calibrated for it (the {SCALED_KV_DTYPES[name]} pass's "
                          f"kv_cache_dtype = \"{name}\"), and the artifact{has}; use kv_dtype = \"auto\"")
    return name


def bytes_per_block(block_size: int, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    values: bool = True) -> int:
    """K and V (K alone without ``values``: MLA's latent) for ``block_size`` tokens in every layer."""
    return (2 if values else 1) * n_layers * block_size * n_kv_heads * head_dim * dtype.itemsize


@dataclass(frozen=True)
class KVCachePlan:
    """The paged KV cache a serving plan buys for one model: its dtype (a ``KV_DTYPES`` name) and
    how many blocks of how many tokens. Computed in one place, ``plan_kv_cache``: the paged_kv pass
    records it (``ServingPlan.resolved``), and the engine builds its cache from the recorded plan."""

    kv_dtype: str
    block_size: int
    num_blocks: int
    bytes_per_block: int

    @property
    def mib(self) -> float:
        return self.num_blocks * self.bytes_per_block / 2**20

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size


def plan_kv_cache(plan: ServingPlan, config, model_dtype: str, kv_cache: dict | None) -> KVCachePlan:
    """The KV cache of ``plan`` for a model of ``config`` (its ``kv_cache_layout`` and layers) in
    ``model_dtype``, with the artifact's ``kv_cache`` entry (``resolve_kv_dtype``). A plan already
    resolved (as recorded by the paged_kv pass: a dtype name and ``num_blocks``) comes back as it is."""
    kv_dtype = resolve_kv_dtype(plan.kv_dtype, model_dtype, kv_cache)
    heads, dim, values = config.kv_cache_layout
    per_block = bytes_per_block(plan.block_size, config.n_layers, heads, dim, KV_DTYPES[kv_dtype], values)
    num_blocks = plan.num_blocks or max(1, int(plan.kv_memory_mb * 2**20) // per_block)
    return KVCachePlan(kv_dtype, plan.block_size, num_blocks, per_block)
