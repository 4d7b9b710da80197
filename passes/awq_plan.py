"""AWQ's options and the per-layer group-size plan (its scaling groups: ``awq_mappings.py``).

Planning needs only the model's module names and shapes (the model on the meta device), so the
plan (``AwqPlan``, made once by the pipeline's validate) and the target checks come before any
calibration work.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Literal

import torch.nn as nn

from compiler.errors import ConfigError
from compiler.formats.int8 import Int8Format
from compiler.formats.qlinear import linear_modules
from compiler.model.config import ModelConfig
from compiler.model.moe import router_names
from compiler.pipeline import PassPlan
from compiler.pipeline.memory import activation_terms, linear_inputs
from compiler.pipeline.selection import excluded_by
from compiler.quant.gguf_blocks import BLOCK_TYPES, FALLBACK
from compiler.quant.int4 import GROUP_SIZES, padded_width

# The awq pass's formats: qcompile's INT4, or a llama.cpp block type ("_m": Q4_K with Q6_K where measured most sensitive).
GGUF_FORMATS = {"gguf:q4_0": "q4_0", "gguf:q4_1": "q4_1", "gguf:q4_k": "q4_k", "gguf:q4_k_m": "q4_k"}
AWQ_FORMATS = ("int4", *GGUF_FORMATS)


@dataclass
class AWQOptions:
    """Options of the ``awq`` pass (see ``passes/awq.py``).

    [[passes]]
    name = "awq"
    group_size = 128              # 32, 64, 128 or 256
    group_size_policy = "fallback"  # when g does not divide in_features: error | fallback | pad
    zero_point = true             # asymmetric (false: symmetric, zero point 8)
    alpha_grid = 20               # α in {0, 1/20, …, 19/20}
    duo_scaling = "auto"          # s = mean|x|^α / mean|ŵ|^(1-α): "all" groups (AutoAWQ), "auto" (all but up → down), "none" (s = mean|x|^α)
    module_candidates = 4         # the best α by the linears' own error, re-scored on the module's output
    module_sequences = 4          # calibration sequences those module forwards run on
    clip_search = true            # per-group max-value shrink, grid of clip_grid * max_shrink points
    max_layer_error = 0.1         # retry a layer with the next smaller group above this relative error
    search_tokens = 8192          # tokens per block the searches' Gram matrices are built on
    weight_rounding = "gptq"      # GPTQ's error-compensating rounding on AWQ's scales and clip ("nearest": RTN)
    gptq_damp = 0.01              # GPTQ's dampening, a fraction of the Hessian's mean diagonal
    modules_to_not_convert = ["lm_head"]  # kept in float: globs over names or dotted parts (compiler/pipeline/selection.py); [] quantizes lm_head too
    min_expert_tokens = 32        # MoE: an expert routed fewer calibration tokens than this is "starved"
    starved_experts = "all_tokens"  # calibrate a starved expert on every token of its layer, or "rtn": round-to-nearest
    format = "int4"               # or a llama.cpp block type for `lower --target gguf`: "gguf:q4_0", "gguf:q4_1",
                                  # "gguf:q4_k", "gguf:q4_k_m" (Q4_K, and Q6_K for the layers measured most sensitive)
    average_bits = 4.5            # int4 only, default off: INT8 (W8A16) for the layers measured most sensitive, up to
                                  # this many bits per weight over the converted layers, as the artifact stores them
    scale_refit = true            # default false: least-squares scales on the chosen codes, per row where they lower its error
    sensitivity = "kl"            # default "none": also each layer's end-to-end KL alone (kl_alone; slow, see below)
    validation_windows = 4        # windows of [calibration].seq_len tokens sensitivity = "kl" is measured on

    With a ``gguf:`` format every search and GPTQ's rounding work on that block type's grid
    (``compiler/quant/gguf_blocks.py``); group_size and zero_point are the type's. A row a K-quant's
    256-weight super-block does not divide takes llama.cpp's fallback (Q4_K -> Q5_0, Q6_K -> Q8_0);
    one 32 does not divide cannot be stored in GGUF and is an error naming it.
    MoE routers stay in float whatever the options say (``ArchSpec.router``).

    ``average_bits`` (NNCF's ratio with an INT8 backup, by measured error): every layer is also
    quantized on the INT8 per-channel grid (GPTQ on the same Gram matrix; ``Int8Linear`` W8A16, its
    scales float16 values as INT4's), and after the last block the units whose output error INT8
    lowers most per extra bit get it until the converted layers average ``average_bits`` bits per
    weight (codes, scales, zero points and biases as ``qcompile inspect`` counts them). A unit is
    what vLLM and the engine run as one layer: a block's q/k/v, its gate/up, a MoE layer's experts,
    else one linear. The model is compiled whole (no ``--streaming on``), and INT8 candidates cost
    a byte per weight of memory until then.

    ``scale_refit``: once GPTQ (or RTN) has chosen the codes q of an INT4 or INT8 layer, each row's
    scales are re-fit by least squares on them, s = argmin ||X (W - s (q - z))ᵀ||² over the row's
    groups with the full Gram matrix (NNCF's scale estimation, in closed form), rounded as the format
    stores scales, and kept per row where they lower that row's output error (so never a layer's).
    GGUF block types keep llama.cpp's fields (no re-fit). Off by default, chosen on SmolLM2's
    validation split (``benchmarks/awq_quality.py --one awq:128 --samples 32 --windows 15 --split
    validation --corpora pydoc,stdlib-docs --set scale_refit=…``): perplexity 13.120 / 13.764 on
    pydoc / stdlib-docs with it against 13.108 / 13.750 without (lower calibration errors, not a
    better model), for 16% more compile CPU time.

    ``sensitivity = "kl"``: after the compile, each converted layer's mean per-token KL from the
    float model when it alone is quantized (``kl_alone``), on ``validation_windows`` windows of the
    calibration corpus' validation region. With ``average_bits`` (or ``gguf:q4_k_m``) it also chooses
    the wider units by end-to-end gain: the whole INT4 model's KL from float on those windows less the
    same with that unit alone on the wider grid, per extra bit, where the default ranks units by their
    own output error. Costs a float copy of the model (scales folded) and one forward over those
    windows per converted layer and per unit: on SmolLM2 210 + 120 forwards of 4 x 512 tokens, about
    10 s each on 2 busy cores, about an hour (fewer ``validation_windows`` cut it); compiled whole.
    """

    group_size: int = 128
    zero_point: bool = True
    alpha_grid: int = 20
    clip_search: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5
    modules_to_not_convert: list[str] = field(default_factory=lambda: ["lm_head"])
    group_size_policy: Literal["error", "fallback", "pad"] = "fallback"
    max_layer_error: float | None = None
    search_tokens: int = 8192
    duo_scaling: Literal["auto", "all", "none"] = "auto"
    weight_rounding: Literal["gptq", "nearest"] = "gptq"
    gptq_damp: float = 0.01
    module_candidates: int = 4
    module_sequences: int = 4
    batch_size: int = 8
    min_expert_tokens: int = 32
    starved_experts: Literal["all_tokens", "rtn"] = "all_tokens"
    format: str = "int4"
    average_bits: float | None = None
    scale_refit: bool = False  # off: worse perplexity on SmolLM2's validation split (the docstring)
    sensitivity: Literal["none", "kl"] = "none"
    validation_windows: int = 4

    def __post_init__(self):
        if self.format not in AWQ_FORMATS:
            raise ValueError(f"format must be one of {', '.join(AWQ_FORMATS)}, got {self.format!r}")
        if self.average_bits is not None and self.format != "int4":
            raise ValueError(f"average_bits mixes INT4 and INT8 layers: format must be \"int4\", got {self.format!r} "
                             "(gguf:q4_k_m spends llama.cpp's bits by sensitivity)")
        if self.average_bits is not None and not 4 < self.average_bits <= 8:
            raise ValueError(f"average_bits must be above INT4's 4 bits and at most INT8's 8, got {self.average_bits}")
        if self.scale_refit and self.format != "int4":
            raise ValueError("scale_refit re-fits INT4 / INT8 scales; GGUF block types keep llama.cpp's fields")
        if self.validation_windows < 1:
            raise ValueError(f"validation_windows must be >= 1, got {self.validation_windows}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {self.group_size}")
        if self.alpha_grid < 1 or self.clip_grid < 1:
            raise ValueError("alpha_grid and clip_grid must be >= 1")
        if not 0 < self.max_shrink < 1:
            raise ValueError(f"max_shrink must be in (0, 1), got {self.max_shrink}")
        if self.max_layer_error is not None and self.max_layer_error <= 0:
            raise ValueError(f"max_layer_error must be > 0, got {self.max_layer_error}")
        if self.search_tokens < 1 or self.batch_size < 1:
            raise ValueError("search_tokens and batch_size must be >= 1")
        if not 0 < self.gptq_damp < 1:
            raise ValueError(f"gptq_damp must be in (0, 1), got {self.gptq_damp}")
        if self.module_candidates < 0 or self.module_sequences < 0:
            raise ValueError("module_candidates and module_sequences must be >= 0 (0 or 1: score on the linears' own error)")
        if self.min_expert_tokens < 1:
            raise ValueError(f"min_expert_tokens must be >= 1, got {self.min_expert_tokens}")


@dataclass(frozen=True)
class LayerPlan:
    """The group size a linear gets before any work, and why."""

    name: str
    in_features: int
    out_features: int
    group_size: int
    reason: str

    block_type: str | None = None  # a llama.cpp block type (``format = "gguf:..."``), else INT4

    def format(self, zero_point: bool) -> dict:
        """The manifest entry ``Int4Linear.format_meta`` (or ``GgufLinear``'s) will write for this layer."""
        if self.block_type:
            return {"format": "gguf", "block_type": self.block_type, "in_features": self.in_features,
                    "out_features": self.out_features, "padded_in_features": self.in_features}
        return {"format": "int4", "group_size": self.group_size, "zero_point": zero_point,
                "in_features": self.in_features, "out_features": self.out_features,
                "padded_in_features": padded_width(self.in_features, self.group_size)}


def fallback_group(in_features: int, group_size: int) -> int | None:
    """The largest allowed group size below ``group_size`` that divides ``in_features``."""
    return next((g for g in sorted(GROUP_SIZES, reverse=True) if g < group_size and in_features % g == 0), None)


def smaller_groups(in_features: int, group_size: int, policy: str) -> list[int]:
    """Group sizes a layer may retry with (``max_layer_error``), largest first."""
    return [g for g in sorted(GROUP_SIZES, reverse=True)
            if g < group_size and (policy == "pad" or in_features % g == 0)]


def compact_names(names: list[str]) -> str:
    """'layers.{0-29}.self_attn.q_proj, lm_head': every layer named, compactly."""
    by_suffix: dict[str, list[int]] = defaultdict(list)
    others = []
    for n in names:
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", n)
        if m:
            by_suffix[m.group(2)].append(int(m.group(1)))
        else:
            others.append(n)
    parts = [f"layers.{r if r.isdigit() else '{' + r + '}'}.{s}" for s, ix in by_suffix.items()
             for r in [_ranges(ix)]] + others
    return ", ".join(parts)


def _ranges(ix: list[int]) -> str:
    ix = sorted(ix)
    out, start = [], ix[0]
    for a, b in zip(ix, ix[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


@dataclass(frozen=True)
class AwqPlan(PassPlan):
    """The awq pass's plan: what ``plan_layers`` found, kept for the run."""

    layers: dict[str, LayerPlan] = field(default_factory=dict)  # the linears to convert
    excluded: dict[str, str] = field(default_factory=dict)  # {linear left in float: the pattern naming it}


def plan_layers(model: nn.Module, options: AWQOptions) -> tuple[dict[str, LayerPlan], dict[str, str]]:
    """(plans of the float linears of ``model`` (or its meta-device twin) to convert, {excluded
    linear: pattern}); raises on policy ``error``. Routers are in neither: they are never converted."""
    plan_one = _gguf_plan if options.format in GGUF_FORMATS else _int4_plan
    plans, excluded = {}, {}
    offenders: dict[int, list[str]] = defaultdict(list)
    routers = set(router_names(model.config))
    for name, linear in linear_modules(model).items():
        k, n = linear.in_features, linear.out_features
        if name in routers:
            continue
        if (pattern := excluded_by(name, options.modules_to_not_convert)) is not None:
            excluded[name] = pattern
        elif (plan := plan_one(name, k, n, options)) is not None:
            plans[name] = plan
        else:
            offenders[k].append(name)
    if offenders:
        listed = "; ".join(f"{compact_names(names)} (in_features {k})" for k, names in offenders.items())
        raise ConfigError(_offenders_message(options, listed))
    return plans, excluded


def _int4_plan(name: str, k: int, n: int, options: AWQOptions) -> LayerPlan | None:
    """The requested group size, or what the group-size policy makes of it (None: it cannot)."""
    g = options.group_size
    if k % g == 0:
        return LayerPlan(name, k, n, g, "requested")
    if options.group_size_policy == "pad":
        return LayerPlan(name, k, n, g, f"pad: in_features {k} zero-padded to {padded_width(k, g)}")
    if options.group_size_policy == "fallback" and (fb := fallback_group(k, g)):
        return LayerPlan(name, k, n, fb, f"fallback: {g} does not divide in_features {k}")
    return None


def _gguf_plan(name: str, k: int, n: int, options: AWQOptions) -> LayerPlan | None:
    """The llama.cpp block type, or llama.cpp's fallback where a K-quant's super-block does not
    divide the row (None: no block divides it; a GGUF row cannot be padded)."""
    requested = GGUF_FORMATS[options.format]
    t, reason = BLOCK_TYPES[requested], "requested"
    if k % t.super and requested in FALLBACK:
        t, reason = BLOCK_TYPES[FALLBACK[requested]], f"llama.cpp's fallback: {t.super} does not divide in_features {k}"
    return None if k % t.super else LayerPlan(name, k, n, t.sub, reason, t.name)


def _offenders_message(options: AWQOptions, listed: str) -> str:
    if options.format in GGUF_FORMATS:
        return (f"awq: format {options.format!r}: GGUF blocks of 32 do not divide in_features of {listed}; "
                "use format = \"int4\" with group_size_policy = \"pad\", or keep them in float (modules_to_not_convert)")
    fix = ('use group_size_policy = "pad"' if options.group_size_policy == "fallback"
           else 'use group_size_policy = "fallback" or "pad", or a group size that divides them')
    return f"awq: group_size {options.group_size} does not divide in_features of {listed}; {fix}"


def wider_format(options: AWQOptions, plan: LayerPlan) -> dict | None:
    """The manifest entry a layer measured sensitive may get instead of its planned one: ``average_bits``'
    INT8 W8A16 (``passes/awq_grid.py``'s ``Int8Grid``), q4_k_m's Q6_K (or its fallback); None without either."""
    if options.average_bits is not None:
        return Int8Format(in_features=plan.in_features, out_features=plan.out_features,
                          activation_scheme="none").to_dict()
    wide = wider_type(options, plan)
    return None if wide is None else replace(plan, block_type=wide).format(options.zero_point)


def wider_type(options: AWQOptions, plan: LayerPlan) -> str | None:
    """``gguf:q4_k_m``: the type a layer measured sensitive is upgraded to (Q6_K, or its fallback Q8_0)."""
    if options.format != "gguf:q4_k_m":
        return None
    return "q6_k" if plan.in_features % BLOCK_TYPES["q6_k"].super == 0 else FALLBACK["q6_k"]


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers its Q4_K_M recipe gives Q6_K attn_v and ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_budget(options: AWQOptions, plans: dict[str, LayerPlan], n_layers: int) -> float:
    """The extra bits llama.cpp's Q4_K_M recipe spends on this model (Q6_K for attn_v and ffn_down
    of ``_more_bits`` layers): the budget qcompile's sensitivity-chosen upgrades spend instead."""
    extra = 0.0
    for i in range(n_layers):
        for suffix in ("self_attn.v_proj", "mlp.down_proj"):
            plan = plans.get(f"layers.{i}.{suffix}")
            if plan is not None and _more_bits(i, n_layers):
                wide = BLOCK_TYPES[wider_type(options, plan)]
                extra += plan.in_features * plan.out_features * (wide.bits - BLOCK_TYPES[plan.block_type].bits)
    return extra


def awq_working_memory(config: ModelConfig, calibration, options: AWQOptions, dtype_bytes: int) -> dict[str, int]:
    """Bytes AWQ holds beyond the weights, a block at a time whether streamed or not
    (``compiler/pipeline/memory.py``): the calibration activations, one chunk's block forward,
    each scaling group's Gram matrix (and its rescaled copy), GPTQ's factorisations of the
    widest, and the float32 copies the scale and clip searches make of the widest group."""
    widths = linear_inputs(config)
    grams = 2 * sum(k * k for k in widths) * 4 + 4 * max(widths) ** 2 * 4
    qkv_rows = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
    widest_group = max(qkv_rows * config.dim, 2 * config.intermediate_size * config.dim)
    terms = activation_terms(config, calibration.samples, calibration.seq_len, options.batch_size, dtype_bytes)
    if excluded_by("lm_head", options.modules_to_not_convert) is None:
        # the head is the last scaling group, and with a large vocabulary (Gemma 3: 262k x 640) the widest one
        head = config.vocab_size * config.dim
        widest_group = max(widest_group, head)
        if config.tie_embeddings:  # the quantized head is an untied copy of the embedding
            terms["untied lm_head"] = head * dtype_bytes
    return {**terms, "Gram / Hessian matrices": grams, "scale and clip search": 4 * widest_group * 4}
