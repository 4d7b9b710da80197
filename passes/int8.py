"""The ``int8`` pass: SmoothQuant migration, then INT8 weights per output channel (GPTQ-rounded),
with INT8 activations per token (dynamic) or per tensor (static), or none (W8A16).

    [[passes]]
    name = "int8"
    activation_scheme = "dynamic"       # "dynamic" per token, "static" per tensor, "none" (W8A16)
    activation_symmetric = true         # false: a zero point (dynamic: per token; static: per tensor)
    smoothing = "all"                   # SmoothQuant on every group (norm → q/k/v, v → o, norm → gate/up,
                                        # up → down); "norms": the first kind only (llm-compressor's
                                        # default mappings); "none" (W8A16's default)
    smoothing_strength = "auto"         # migration strength α, or "auto": chosen on the validation split
                                        # among the grid's and a per-group search's
    smoothing_grid = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    weight_rounding = "gptq"            # or "nearest"
    static_range = "minmax"             # static: the whole calibrated range, or "search": the shrink
                                        # with the least layer error on the sampled rows
    dynamic_fallback = 0                # static: this many units whose static range costs the most keep
                                        # dynamic symmetric activations per token (vllm-ascend's
                                        # W8A8_DYNAMIC; msModelSlim's disable_level rolls them to float)
    modules_to_not_convert = ["lm_head", "embed_tokens"]
    kv_cache_dtype = "none"             # "int8": a static INT8 KV cache, symmetric per channel (vllm-ascend's "C8")

Phases, the model in memory (``scope`` "model": the strength is chosen on whole-model losses):

1. **SmoothQuant** (Xiao et al., ICML 2023): per scaling group (the AWQ mappings,
   ``passes/awq_mappings.py``: an input norm → q/k/v, v → o, the MLP's norm → gate/up, up → down;
   with ``smoothing = "norms"`` only those a norm feeds, as llm-compressor's default mappings), s_j = max|X_j|^α / max|W_j|^(1-α) over the calibration tokens
   and the group's weight columns; the input columns take s and the norm (or Linear) before them 1/s,
   so the float model is unchanged and the activations' outlier channels move into the weights,
   which INT8 per channel holds more easily. With ``smoothing_strength = "auto"`` the candidates are
   each α of the grid for every group, and "per group": each group's α from the grid with the least
   output error of its Linears on sampled calibration rows (weights RTN, activations as configured,
   a static range smoothed with them). Each is tried on a copy (round-to-nearest weights, the
   configured activations, static ranges included) and scored by its mean per-token KL from the float
   model on the calibration corpus' validation region (``validation_windows`` windows, never the
   evaluation region the figures are reported on); the report gives every candidate's KL and NLL.
   On SmolLM2's validation split the per-group candidate lowered dynamic W8A8's KL by a third
   (0.0068 / 0.0073 on pydoc / stdlib-docs against one α's 0.0102 / 0.0100), and scoring static
   trials as static (they were scored as dynamic) took static activations from +19% perplexity
   to +2.1% (docs/notes/2026-12-int8-w8a8-smoothquant.md).
2. **Calibrate** the smoothed model: per converted Linear, XᵀX (GPTQ), a row sample (the error
   column of the report) and, for static activations, each channel's range: the tensor's min/max
   give the scale and zero point; with ``static_range = "search"`` that range shrunk by the factor
   of ``STATIC_CLIPS`` whose layer output error on the sampled rows (each token's relative to its
   own output, averaged) is least. On SmolLM2's validation split (static trials then scored as
   dynamic) the search lowered each layer's error but not the model's: +20.5% / +25.0% perplexity against the whole range's +19.2% / +18.9%
   (pydoc / stdlib-docs), so the whole range is the default.
3. **Quantize**: symmetric per-channel scales from the smoothed weight's abs-max, codes by GPTQ's
   error-compensating rounding on them (``passes/gptq.py``); the report's rows give each layer's
   relative output error on the sampled calibration rows (the quantized activations included).
   With ``dynamic_fallback = N`` (static activations) the units first ranked: a unit is the Linears
   reading one input (a block's q/k/v, o_proj, gate/up or down_proj, which vLLM and vllm-ascend
   fuse or run alone, so one unit has one activation scheme); its cost is how much the model's KL
   from float on the validation windows drops when that unit alone takes dynamic symmetric
   activations on a copy with every other unit static (RTN weights, as the strengths are scored),
   and the N costliest keep them: one range per tensor cannot serve the tokens of a layer whose
   inputs carry a few huge values. The report names them with the KL each leaves.
4. **KV cache** (``kv_cache_dtype = "int8"``): K (after the rotary embedding) and V of every layer
   over the calibration windows, through the quantized model (its K/V come from the INT8 q/k/v
   projections the artifact runs, so their ranges are the served model's); one scale per channel
   (n_kv_heads × head_dim per layer) from the abs-max / 127, rounded up onto bfloat16's grid
   (``compiler/formats/kv_quant.py``), recorded in the manifest's ``kv_cache`` entry and installed
   as the model's K/V rounding.

Mixture-of-experts and MLA architectures are refused (their per-expert smoothing and starved
experts are not implemented here): compile them with ``fp8`` or ``awq``.
"""
from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from compiler.errors import ConfigError
from compiler.formats.int8 import Int8Format, Int8Linear
from compiler.formats.kv_quant import INT8, install_kv_quant, kv_cache_entry
from compiler.formats.qlinear import linear_modules
from compiler.model.config import ModelConfig
from compiler.model.fusion import fused_unit
from compiler.model.transformer import Transformer
from compiler.pipeline import LayerDecision, Pass, PassContext, PassPlan, PassReport, register_pass
from compiler.pipeline.calibration import InputRequest, InputStatistics
from compiler.pipeline.memory import converted_weights, linear_inputs
from compiler.pipeline.selection import select_linears
from compiler.progress import track
from compiler.quant.int8 import asymmetric_qparams, dequantize_weight, quantize_weight, symmetric_scales, weight_scale
from passes.awq_mappings import SMOOTHING, ScalingGroup, expand_columns, fold_scales, layer_groups
from passes.distill.evaluate import compare_on_windows, teacher_logits
from passes.gptq import gptq_round

CALIBRATION_BATCH = 4
# What this pass provides with kv_cache_dtype = "int8": K/V scales for an INT8 paged cache
# (paged_kv's kv_dtype = "int8" requires it).
INT8_KV_CACHE = "int8_kv_cache"
STATIC_CLIPS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.15, 0.1)  # shrink factors of a static range
NORMS = ("layernorm", "_norm")  # a group whose prev is named so is one SmoothQuant smooths by default
PER_GROUP = "per group"  # the label of the strengths searched per group
Strengths = float | list[float]  # one α for every group, or one per group
Validation = Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]  # the validation windows, the float logits on them


@dataclass
class Int8Options:
    """Options of the ``int8`` pass (see the module docstring)."""

    activation_scheme: Literal["dynamic", "static", "none"] = "dynamic"
    activation_symmetric: bool | None = None  # default: symmetric when dynamic, asymmetric when static
    # Default: "all" with INT8 activations (on SmolLM2's validation split +0.56% / +0.18% perplexity against
    # "norms"' +1.17% / +0.88%: down_proj's input carries the outliers), else "none".
    smoothing: Literal["norms", "all", "none"] | None = None
    smoothing_strength: float | Literal["auto"] = "auto"
    # 0.9: static activations chose 0.8, the old grid's end, on SmolLM2's validation split
    smoothing_grid: list[float] = field(default_factory=lambda: [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    validation_windows: int = 4  # windows of [calibration].seq_len tokens scoring each α
    weight_rounding: Literal["gptq", "nearest"] = "gptq"
    static_range: Literal["minmax", "search"] = "minmax"
    dynamic_fallback: int = 0
    gptq_damp: float = 0.01
    modules_to_not_convert: list[str] = field(default_factory=lambda: ["lm_head", "embed_tokens"])
    calibration_samples: int | None = None
    error_tokens: int = 256
    kv_cache_dtype: Literal["none", "int8"] = "none"
    kv_cache_granularity: ClassVar[str] = "per_channel"  # not an option: the INT8 cache's one granularity

    def __post_init__(self):
        if self.activation_symmetric is None:
            self.activation_symmetric = self.activation_scheme != "static"
        if self.smoothing is None:  # migration helps INT8 activations at the weights' cost: none without them
            self.smoothing = "none" if self.activation_scheme == "none" else "all"
        if self.activation_scheme == "none" and not self.activation_symmetric:
            raise ValueError("activation_symmetric = false needs INT8 activations; W8A16 (activation_scheme = "
                             "\"none\") has none")
        alphas = self.smoothing_grid if self.smoothing_strength == "auto" else [self.smoothing_strength]
        if not alphas or any(isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1 for a in alphas):
            raise ValueError(f"smoothing_strength and smoothing_grid take numbers in [0, 1] (or \"auto\"), got {alphas}")
        for name in ("validation_windows", "error_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dynamic_fallback < 0:
            raise ValueError(f"dynamic_fallback must be >= 0, got {self.dynamic_fallback}")
        if self.dynamic_fallback and self.activation_scheme != "static":
            raise ValueError(f"dynamic_fallback keeps units of a static model dynamic; activation_scheme is "
                             f"\"{self.activation_scheme}\": set activation_scheme = \"static\" or drop it")
        if self.calibration_samples is not None and self.calibration_samples < 1:
            raise ValueError(f"calibration_samples must be >= 1, got {self.calibration_samples}")
        if not 0 < self.gptq_damp < 1:
            raise ValueError(f"gptq_damp must be in (0, 1), got {self.gptq_damp}")

    def format_for(self, linear: nn.Module, dynamic: bool = False) -> Int8Format:
        """The configured format, or with ``dynamic`` (a unit ``dynamic_fallback`` chose) dynamic
        symmetric activations per token."""
        if dynamic:
            return Int8Format.for_linear(linear, activation_scheme="dynamic", activation_symmetric=True)
        return Int8Format.for_linear(linear, activation_scheme=self.activation_scheme,
                                     activation_symmetric=self.activation_symmetric)

    @property
    def alphas(self) -> list[float]:
        return [float(a) for a in (self.smoothing_grid if self.smoothing_strength == "auto"
                                   else [self.smoothing_strength])]


@register_pass
class Int8Pass(Pass):
    """SmoothQuant, then INT8 per-channel weights (W8A8 or W8A16) of the decoder's Linears."""

    name = "int8"
    Options = Int8Options
    provides = frozenset({"int8_weights", INT8_KV_CACHE})

    def __init__(self, options: Int8Options):
        super().__init__(options)
        if options.kv_cache_dtype != INT8:  # no scales an INT8 paged cache can store codes with
            self.provides = type(self).provides - {INT8_KV_CACHE}

    def _select(self, model: nn.Module) -> tuple[list[str], dict[str, str]]:
        return select_linears(model, self.options.modules_to_not_convert)

    def plan(self, model: Transformer) -> PassPlan:
        linears, names = linear_modules(model), self._select(model)[0]
        alternatives = ({n: self.options.format_for(linears[n], dynamic=True).to_dict() for n in names}
                        if self.options.dynamic_fallback else {})
        return PassPlan({n: self.options.format_for(linears[n]).to_dict() for n in names}, alternatives)

    def check(self, model: Transformer) -> None:
        config = model.config
        if config.spec.is_moe or config.spec.attention == "mla" or config.architecture not in SMOOTHING:
            raise ConfigError(f"the int8 pass does not handle {config.architecture} (mixture of experts or latent "
                              "attention); compile it with the fp8 or awq pass")
        units = len(self._units(self._select(model)[0]))
        if self.options.dynamic_fallback > units:
            raise ConfigError(f"dynamic_fallback = {self.options.dynamic_fallback}, but this model has {units} units "
                              "of converted Linears (a block's q/k/v, o_proj, gate/up, down_proj); give at most that")

    def working_memory(self, model: Transformer, calibration, dtype_bytes: int, streamed: bool) -> dict[str, int]:
        o, config = self.options, model.config
        samples = o.calibration_samples or calibration.samples
        chunk = min(CALIBRATION_BATCH, samples) * calibration.seq_len
        forward = chunk * (3 * config.intermediate_size + 6 * config.dim + 2 * config.vocab_size) * 4
        per_block = sum(k * k * 4 + o.error_tokens * k * 4 + 2 * k * 4 for k in linear_inputs(config))
        memory = {"calibration statistics (every block)": config.n_layers * per_block,
                  "model forward (one batch)": forward + chunk * config.n_heads * calibration.seq_len * 4,
                  "INT8 weights (every block)": converted_weights(model, 1)}
        if len(o.alphas) > 1 or o.dynamic_fallback:  # one at a time: each strength tried, then the fallback's ranking
            memory["a copy of the model (a trial)"] = converted_weights(model, dtype_bytes)
        return memory

    def run(self, model: Transformer, context: PassContext) -> PassReport:
        o = self.options
        candidates, excluded = self._select(model)
        groups = self._groups(model)
        scores: dict[str, dict[str, float]] = {}
        strengths: dict[str, Strengths] = {str(a): a for a in o.alphas}
        chosen = next(iter(strengths))
        # the float model's logits on the validation windows, once for the strengths and the fallback's ranking
        validation = functools.cache(functools.partial(self._float_on_validation, model, context))
        if groups:
            # every converted input's range (static trials' ranges) and each group's rows (the per-group search)
            requests = {n: InputRequest(channel_range=True) for n in candidates}
            requests |= {n: InputRequest(channel_range=True, rows=o.error_tokens) for n in _firsts(groups)}
            ranges = self._statistics(model, context, requests, "int8: activation ranges")
            if o.smoothing_strength == "auto":
                strengths[PER_GROUP] = self._search_per_group(model, groups, ranges)
            if len(strengths) > 1:
                scores = self._score_strengths(model, validation, groups, ranges, candidates, strengths)
                chosen = min(scores, key=lambda label: scores[label]["kl"])
            smooth(model, groups, ranges, strengths[chosen])
        request = InputRequest(gram="all" if o.weight_rounding == "gptq" else "none", rows=o.error_tokens,
                               channel_range=o.activation_scheme == "static")
        stats = self._statistics(model, context, {n: request for n in candidates}, "int8: calibrating")
        fallback = self._dynamic_units(model, validation, candidates, stats) if o.dynamic_fallback else []
        dynamic = {name for names, _, _ in fallback for name in names}
        rows = [self._convert(model, name, stats[name], dynamic=name in dynamic)
                for name in track(candidates, "int8: quantizing layers")]
        report = self._report(excluded, rows, strengths[chosen] if groups else None, chosen, scores)
        if fallback:
            report.metrics["dynamic_fallback"] = sorted(dynamic)
            chosen_units = ", ".join(f"{fused_unit(names[0])} {kl:.4f}" for names, _, kl in fallback)
            report.notes.append(f"{len(fallback)} units keep dynamic symmetric activations, their static range costing "
                                f"most (validation KL from float, all static {fallback[0][1]:.4f}, with the unit alone "
                                f"dynamic): {chosen_units}")
        if o.kv_cache_dtype == INT8:
            context.manifest_extras["kv_cache"] = self._kv_cache(model, context)
            report.metrics["kv_cache"] = f"{INT8} {o.kv_cache_granularity}"
        return report

    @staticmethod
    def _units(candidates: list[str]) -> list[list[str]]:
        """The converted Linears grouped as vLLM serves them (``fused_unit``: q/k/v, gate/up; o_proj and
        down_proj alone), so that each unit has one activation scheme."""
        units: dict[str, list[str]] = {}
        for name in candidates:
            units.setdefault(fused_unit(name), []).append(name)
        return list(units.values())

    def _float_on_validation(self, model: Transformer, context: PassContext) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The validation windows and the float model's logits on them (smoothing leaves it the same function)."""
        windows = context.validation_windows(self.options.validation_windows)
        with torch.inference_mode():
            return windows, teacher_logits(model, windows)

    def _dynamic_units(self, model: Transformer, validation: Validation, candidates: list[str],
                       stats: dict[str, InputStatistics]) -> list[tuple[list[str], float, float]]:
        """The ``dynamic_fallback`` units (at most) whose static range costs the model most, costliest first:
        (their Linears, the model's KL from float all static, the same with that unit alone dynamic),
        mean per-token KL on the validation windows of a copy with RTN weights (as the strengths are
        scored). One forward over them per unit: a unit's own output error missed what follows it."""
        o = self.options
        windows, reference = validation()
        trial = copy.deepcopy(model)
        with torch.inference_mode():
            static, dynamic = {}, {}
            for name in candidates:
                linear = trial.get_submodule(name)
                static[name] = Int8Linear.from_linear(linear, o.format_for(linear), None,
                                                      static_qparams(stats[name], o.activation_symmetric))
                dynamic[name] = Int8Linear.from_linear(linear, o.format_for(linear, dynamic=True))
                trial.set_submodule(name, static[name])

            def kl() -> float:
                return compare_on_windows(model, trial, windows, reference=reference)["kl"]

            base, costs = kl(), []
            for names in track(self._units(candidates), "int8: KL of each unit's static range"):
                for name in names:
                    trial.set_submodule(name, dynamic[name])
                costs.append((names, base, kl()))
                for name in names:
                    trial.set_submodule(name, static[name])
        costs.sort(key=lambda unit: unit[2])  # least KL with the unit dynamic: its static range cost most
        return [unit for unit in costs[: o.dynamic_fallback] if unit[2] < base]  # one that gains nothing stays static

    def _kv_cache(self, model: Transformer, context: PassContext) -> dict:
        """The INT8 KV cache's entry, calibrated on the quantized model (after the weights: K/V are
        then those of the INT8 q/k/v projections the artifact serves), and installed in it."""
        windows = context.calibration_windows(self.options.calibration_samples)
        stats = context.input_statistics(model, windows, {}, kv_heads=True, label="int8: KV-cache scales",
                                         batch_size=CALIBRATION_BATCH)
        entry = kv_cache_entry(INT8, self.options.kv_cache_granularity, stats.kv)
        install_kv_quant(model, entry)
        return entry

    def _groups(self, model: Transformer) -> list[tuple[int, ScalingGroup]]:
        """(layer, group) pairs to smooth, by the ``smoothing`` option."""
        if self.options.smoothing == "none":
            return []
        chosen = []
        for i in range(model.config.n_layers):
            for g in layer_groups(model.config, i):
                if g.prev is not None and (self.options.smoothing == "all" or g.prev.endswith(NORMS)):
                    chosen.append((i, g))
        return chosen

    def _statistics(self, model: Transformer, context: PassContext, requests: dict, label: str
                    ) -> dict[str, InputStatistics]:
        windows = context.calibration_windows(self.options.calibration_samples)
        return context.input_statistics(model, windows, requests, label=label, batch_size=CALIBRATION_BATCH).inputs

    def _search_per_group(self, model: Transformer, groups, ranges) -> list[float]:
        """Each group's α: the grid's with the least output error of the group's Linears on its sampled
        rows (weights RTN, activations as configured). Per-row weight scales make the groups independent:
        smoothing a later group only rescales an earlier group's output channels, which per-channel
        weight scales absorb."""
        chosen = []
        for i, group in track(groups, "int8: smoothing strength per group"):
            block, stats = model.layers[i], ranges[f"layers.{i}.{group.linears[0]}"]
            references = float_outputs(block, group, stats.rows)  # once per group, not once per α
            errors = {a: self._group_error(block, group, model.config, stats, references, a) for a in self.options.alphas}
            chosen.append(min(errors, key=errors.get))
        return chosen

    def _group_error(self, block: nn.Module, group: ScalingGroup, config: ModelConfig, stats: InputStatistics,
                     references: list[torch.Tensor], alpha: float) -> float:
        """Mean per-token relative output error of ``group``'s Linears smoothed by ``alpha`` and quantized,
        against their float outputs ``references`` on the group's sampled rows."""
        _, cols = smoothing_scales(block, group, config, stats, alpha)
        x = stats.rows.float()
        errors = []
        with torch.inference_mode():
            for name, reference in zip(group.linears, references, strict=True):
                smoothed = _scaled_copy(block.get_submodule(name), cols)
                fmt = self.options.format_for(smoothed)
                qparams = static_qparams(stats, fmt.activation_symmetric, columns=cols) if fmt.static else None
                y = Int8Linear.from_linear(smoothed, fmt, None, qparams)(x / cols)
                errors.append(token_relative_error(y, reference))
        return sum(errors) / len(errors)

    def _score_strengths(self, model: Transformer, validation: Validation,
                         groups, ranges, candidates, strengths: dict[str, Strengths]) -> dict[str, dict[str, float]]:
        """{label: {"kl", "nll"}} on the validation windows of a copy smoothed by that strength and
        RTN-quantized with the configured activations (static ranges: the calibrated ones, smoothed):
        the mean per-token KL from the float model, and the mean NLL."""
        o = self.options
        windows, reference = validation()
        scores = {}
        for label, strength in track(list(strengths.items()), "int8: smoothing strengths"):
            trial = copy.deepcopy(model)
            columns = smooth(trial, groups, ranges, strength)
            for name in candidates:
                linear = trial.get_submodule(name)
                fmt = o.format_for(linear)
                qparams = (static_qparams(ranges[name], fmt.activation_symmetric, columns=columns.get(name))
                           if fmt.static else None)
                trial.set_submodule(name, Int8Linear.from_linear(linear, fmt, None, qparams))
            with torch.inference_mode():
                result = compare_on_windows(model, trial, windows, reference=reference)
            scores[label] = {"kl": result["kl"], "nll": math.log(result["ppl_student"])}
            del trial
        return scores

    def _convert(self, model: Transformer, name: str, stats: InputStatistics, dynamic: bool = False) -> LayerDecision:
        o = self.options
        linear = model.get_submodule(name)
        fmt = o.format_for(linear, dynamic)
        weight = None
        if o.weight_rounding == "gptq":
            scale = weight_scale(linear.weight)[:, None]
            weight = gptq_round(linear.weight, stats.hessian,
                                lambda cols, _: dequantize_weight(quantize_weight(cols, scale[:, 0]), scale[:, 0]),
                                damp=o.gptq_damp)
        row = LayerDecision(name, "int8", "dynamic_fallback: its static range costs most" if dynamic else "requested")
        clips = STATIC_CLIPS if fmt.static and o.static_range == "search" else (1.0,)
        best, q = math.inf, None
        with torch.inference_mode():
            x = stats.rows.to(linear.weight.dtype)
            ref = linear(x).float()
            for clip in clips:
                qparams = static_qparams(stats, fmt.activation_symmetric, clip) if fmt.static else None
                candidate = Int8Linear.from_linear(linear, fmt, weight, qparams)
                y = candidate(x).float()
                per_token = token_relative_error(y, ref)
                if q is None or per_token < best:
                    best, q = per_token, candidate
                    err = float((y - ref).norm() / ref.norm().clamp(min=1e-30))
                    row.metrics["output_error"] = err if math.isfinite(err) else math.inf
                    row.metrics["token_rel_error"] = per_token
                    if qparams is not None:
                        row.metrics |= {"input_scale": qparams[0], "static_clip": clip}
                        if qparams[1] is not None:
                            row.metrics["input_zero_point"] = qparams[1]
        q.drop_derived()
        model.set_submodule(name, q)
        return row

    def _report(self, excluded: dict[str, str], rows: list[LayerDecision], strength: Strengths | None,
                label: str, scores: dict[str, dict[str, float]]) -> PassReport:
        o = self.options
        report = PassReport(self.name)
        report.layers = [LayerDecision(n, "float", f"modules_to_not_convert {p!r}") for n, p in excluded.items()]
        report.layers += rows
        report.metrics |= {"converted": len(rows), "scheme": "W8A16" if o.activation_scheme == "none" else "W8A8",
                           "activations": o.activation_scheme, "activation_symmetric": o.activation_symmetric,
                           "smoothing": o.smoothing,
                           "smoothing_strength": label if isinstance(strength, list) else strength}
        if isinstance(strength, list):
            report.metrics["smoothing_strength_by_group"] = strength
            counts = {a: strength.count(a) for a in sorted(set(strength))}
            report.notes.append("smoothing strength per group (the grid's least layer error): "
                                + ", ".join(f"α={a}: {n} groups" for a, n in counts.items()))
        if scores:
            report.metrics["validation_kl_by_strength"] = {k: round(v["kl"], 6) for k, v in scores.items()}
            report.metrics["validation_nll_by_strength"] = {k: round(v["nll"], 6) for k, v in scores.items()}
            report.notes.append(f"smoothing strength {label} chosen on the validation split (least KL from float): "
                                + ", ".join(f"{k}: KL {v['kl']:.4f}, NLL {v['nll']:.4f}" for k, v in scores.items()))
        if excluded:
            report.notes.append(f"not converted (modules_to_not_convert): {', '.join(excluded)}")
        return report


def _firsts(groups: list[tuple[int, ScalingGroup]]) -> list[str]:
    """The Linear whose input stands for each group's (its first member: it reads every token)."""
    return [f"layers.{i}.{g.linears[0]}" for i, g in groups]


def smoothing_scales(block: nn.Module, group: ScalingGroup, config: ModelConfig, stats: InputStatistics,
                     alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SmoothQuant's s = max|X|^α / max|W|^(1-α) over ``prev``'s channels, and over the members' input
    columns (the same but for GQA's v → o, where each v channel feeds several o columns)."""
    x_max = torch.maximum(stats.channel_min.abs(), stats.channel_max.abs())
    w_max = torch.stack([block.get_submodule(n).weight.detach().abs().amax(0).float() for n in group.linears]).amax(0)
    expand = expand_columns(block, group, config)
    if expand is not None:  # GQA v → o: one scale per v channel, over the o columns it feeds
        channels = block.get_submodule(group.prev).weight.shape[0]
        x_max = torch.zeros(channels).scatter_reduce(0, expand, x_max, "amax")
        w_max = torch.zeros(channels).scatter_reduce(0, expand, w_max, "amax")
    s = x_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
    s = torch.where((x_max > 0) & (w_max > 0) & torch.isfinite(s), s, torch.ones_like(s)).clamp(1e-4, 1e4)
    return s, (s if expand is None else s[expand])


@torch.no_grad()
def smooth(model: Transformer, groups: list[tuple[int, ScalingGroup]], ranges: dict[str, InputStatistics],
           strength: Strengths) -> dict[str, torch.Tensor]:
    """Fold SmoothQuant's scales into each group (the float model is unchanged); ``strength`` is one α
    or one per group. Returns each smoothed Linear's column scales (its input is now x / s)."""
    alphas = strength if isinstance(strength, list) else [strength] * len(groups)
    columns = {}
    for (i, group), alpha in zip(groups, alphas, strict=True):
        block = model.layers[i]
        s, cols = smoothing_scales(block, group, model.config, ranges[f"layers.{i}.{group.linears[0]}"], alpha)
        fold_scales(block, group, s, cols)
        columns |= {f"layers.{i}.{n}": cols for n in group.linears}
    return columns


@torch.inference_mode()
def float_outputs(block: nn.Module, group: ScalingGroup, rows: torch.Tensor) -> list[torch.Tensor]:
    """Each of ``group``'s Linears' float32 output on ``rows``."""
    x = rows.float()
    return [F.linear(x, block.get_submodule(n).weight.float(), _float(block.get_submodule(n).bias)) for n in group.linears]


def static_qparams(stats: InputStatistics, symmetric: bool, clip: float = 1.0,
                   columns: torch.Tensor | None = None) -> tuple[float, int | None]:
    """A static format's (scale, zero point): the calibration tokens' range over every channel, with 0
    in it, shrunk by ``clip``; ``columns``: the smoothing's column scales, when the range was taken
    before it."""
    low_c, high_c = stats.channel_min, stats.channel_max
    if columns is not None:
        low_c, high_c = low_c / columns, high_c / columns
    low = clip * float(low_c.min().clamp(max=0))
    high = clip * float(high_c.max().clamp(min=0))
    if symmetric:
        amax = max(-low, high)
        return (float(symmetric_scales(torch.tensor(amax))) if amax > 0 else 1.0), None
    scale, zero_point = asymmetric_qparams(torch.tensor(low), torch.tensor(high))
    return (float(scale) if float(scale) > 0 else 1.0), int(zero_point)


def token_relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Each token's output error relative to its own output, averaged (a few huge tokens must not
    outweigh the rest); inf when not finite."""
    error = float(((y.float() - ref).norm(dim=1) / ref.norm(dim=1).clamp(min=1e-30)).mean())
    return error if math.isfinite(error) else math.inf


def _scaled_copy(linear: nn.Linear, columns: torch.Tensor) -> nn.Linear:
    """A float32 copy of ``linear`` with its input columns scaled by ``columns``."""
    copy_ = nn.utils.skip_init(nn.Linear, linear.in_features, linear.out_features, bias=linear.bias is not None)
    copy_.weight.copy_(linear.weight.float() * columns)
    if linear.bias is not None:
        copy_.bias.copy_(linear.bias.float())
    return copy_


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()
