"""The ``fp8`` pass: FP8 (E4M3 / E5M2) weights, activations and KV cache, with a per-layer fallback.

    [[passes]]
    name = "fp8"
    weight_dtype = "float8_e4m3fn"      # or "float8_e5m2"
    granularity = "per_channel"         # weight scales: "per_channel" (one per output row) or "per_tensor"
    activation_scheme = "dynamic"       # "dynamic" per token, "static" per tensor, "none" (weight-only)
    activation_group_size = 0           # dynamic: one scale per token (0) or per token and G channels
    input_shift = true                  # subtract each input channel's calibration mean (OS+)
    outlier_channels = 0                # r input channels per layer kept in the model dtype (QUIK)
    static_calibration = "absmax"       # static scale from the abs-max, or "percentile"
    modules_to_not_convert = ["lm_head", "embed_tokens"]
    max_layer_error = 0.1               # relative output error above which a layer stays in float
    weight_rounding = "gptq"            # error-compensating rounding on calibration inputs; or "nearest"
    kv_cache_dtype = "float8_e4m3fn"    # "none" keeps the KV cache in the model dtype
    min_expert_tokens = 32              # MoE: an expert routed fewer calibration tokens is "starved"
    starved_experts = "all_tokens"      # calibrate it on every token of its layer, or "float": keep it in float

Phases: (1) run the calibration windows through the model in its dtype, the shared collector
(``compiler/pipeline/calibration.py``) recording for each candidate Linear what the options need
of its inputs: the abs-max of every token (static), a sample of rows (the fallback's error), the
Gram matrix XᵀX (GPTQ), and for each attention layer the K/V abs-max per channel. With
``input_shift`` or ``outlier_channels`` a forward before it records each input channel's mean
and mean square (the abs-maxima and XᵀX are then of the inputs less that mean, and the outlier
channels are those of largest mean square of what would be cast), so that case takes two forwards;
(2) quantize each candidate (GPTQ: each weight column in turn, its rounding error pushed onto
the columns not yet rounded; weight scales stay the abs-max ones), measure its relative
output error on the sampled rows and keep it in float if that exceeds ``max_layer_error`` (a
recorded decision, never silent); (3) install the FP8 KV rounding and record its scales in the
manifest's ``kv_cache`` entry for the engine. Formats and buffers: ``compiler/formats/fp8.py``.

Mixture of experts: the routers stay in float (``ArchSpec.router``); each expert's statistics (its
static activation scale among them) are of the tokens routed to it, its rows give their number
(``expert_tokens``), and an expert routed fewer than ``min_expert_tokens`` gets ``starved_experts``'
policy (``passes/moe_calibration.py``), named in its rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn as nn

from compiler.errors import ConfigError
from compiler.formats.fp8 import Fp8Format, Fp8Linear
from compiler.formats.kv_quant import KVObserver, install_kv_quant, kv_cache_entry
from compiler.formats.qlinear import linear_modules
from compiler.io.stream import trim_heap
from compiler.model.moe import every_token_to, router_names
from compiler.model.transformer import Transformer
from compiler.pipeline import (
    BlockStream,
    LayerDecision,
    Pass,
    PassContext,
    PassPlan,
    PassReport,
    register_pass,
)
from compiler.pipeline.calibration import (
    CalibrationStatistics,
    InputRequest,
    InputStatistics,
    collect_block,
    collect_model,
)
from compiler.pipeline.memory import activation_terms, converted_weights, linear_inputs
from compiler.pipeline.selection import select_linears
from compiler.progress import track
from compiler.quant.fp8 import (
    FP8_DTYPES,
    Fp8DtypeName,
    dequantize,
    fp8_max,
    quantize,
    weight_scale,
)
from passes.gptq import gptq_round
from passes.moe_calibration import expert_of, experts_of, starved_linears, starved_reason

# Calibration sequences per forward: the whole-model forward and the streamed block forwards
# must chunk alike for their statistics to agree to the bit.
CALIBRATION_BATCH = 4
# What this pass provides with kv_cache_dtype = "float8_e4m3fn": K/V scales for an FP8 paged cache
# (paged_kv's kv_dtype = "float8_e4m3fn" requires it).
FP8_KV_CACHE = "fp8_kv_cache"


@dataclass
class Fp8Options:
    """Options of the ``fp8`` pass (see the module docstring for an example)."""

    weight_dtype: Fp8DtypeName = "float8_e4m3fn"
    granularity: Literal["per_channel", "per_tensor"] = "per_channel"
    activation_scheme: Literal["dynamic", "static", "none"] = "dynamic"
    activation_dtype: Fp8DtypeName = "float8_e4m3fn"
    # Dynamic scales per token and group of this many input channels (0: per token); a multiple of
    # 16 dividing every converted layer's in_features (SmolLM2: 64 divides 576 and 1536, 128 does not).
    activation_group_size: int = 0
    # Subtract each input channel's calibration mean before quantizing and add W·mean back as a
    # bias (Outlier Suppression+'s shift): FP8 error is relative, so it is then spent on x − mean.
    # On SmolLM2 it cuts the KL to float by 19% (dynamic) and 30% (static); see docs/notes/2026-11-fp8-input-shift.md.
    input_shift: bool = True
    # Keep this many input channels of each Linear (those of largest calibrated mean square, after
    # the shift) out of the FP8 cast, in the model dtype, with their weight columns (QUIK). On
    # SmolLM2, 32 of 576 cut the W8A8 KL to float by a third; see docs/BENCHMARKS.md, "FP8 quality (SmolLM2-135M)".
    outlier_channels: int = 0
    # Static scales: "absmax" covers every calibration token; "percentile" covers that percentile
    # of the tokens' abs-maxima (the rest saturate), trading rare outliers for finer steps.
    static_calibration: Literal["absmax", "percentile"] = "absmax"
    percentile: float = 99.9
    # Globs over a module's full name or its dotted parts ("lm_head", "self_attn", "layers.0"):
    # compiler/pipeline/selection.py.
    modules_to_not_convert: list[str] = field(default_factory=lambda: ["lm_head", "embed_tokens"])
    max_layer_error: float | None = 0.1
    # "gptq": round each weight column in turn and push its error onto the columns not yet
    # rounded, weighted by the inverse Hessian of the calibration inputs (passes/gptq.py).
    weight_rounding: Literal["gptq", "nearest"] = "gptq"
    gptq_damp: float = 0.01
    convert_linears: bool = True  # false: only the KV cache (for measuring it alone)
    kv_cache_dtype: Literal["none", "float8_e4m3fn", "float8_e5m2"] = "none"
    kv_cache_granularity: Literal["per_tensor", "per_head"] = "per_head"
    calibration_samples: int | None = None  # windows to calibrate on; default [calibration].samples
    error_tokens: int = 256  # input rows per layer sampled for the fallback decision
    min_expert_tokens: int = 32
    starved_experts: Literal["all_tokens", "float"] = "all_tokens"

    def __post_init__(self):
        if not 0 < self.percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile}")
        if self.max_layer_error is not None and self.max_layer_error <= 0:
            raise ValueError(f"max_layer_error must be > 0 (or left out for no fallback), got {self.max_layer_error}")
        if self.calibration_samples is not None and self.calibration_samples < 1:
            raise ValueError(f"calibration_samples must be >= 1, got {self.calibration_samples}")
        if not 0 < self.gptq_damp < 1:
            raise ValueError(f"gptq_damp must be in (0, 1), got {self.gptq_damp}")
        if self.outlier_channels < 0:
            raise ValueError(f"outlier_channels must be >= 0, got {self.outlier_channels}")
        if self.error_tokens < 1:
            raise ValueError(f"error_tokens must be >= 1, got {self.error_tokens}")
        if self.min_expert_tokens < 1:
            raise ValueError(f"min_expert_tokens must be >= 1, got {self.min_expert_tokens}")
        if self.activation_group_size < 0 or self.activation_group_size % 16:
            raise ValueError("activation_group_size must be 0 or a positive multiple of 16, "
                             f"got {self.activation_group_size}")
        if self.activation_group_size and self.activation_scheme != "dynamic":
            raise ValueError("activation_group_size needs activation_scheme = \"dynamic\", "
                             f"not {self.activation_scheme!r}")
        if not self.convert_linears and self.kv_cache_dtype == "none":
            raise ValueError("convert_linears = false with kv_cache_dtype = \"none\" converts nothing; "
                             "set a kv_cache_dtype or drop convert_linears")

    def format_for(self, linear: nn.Module) -> Fp8Format:
        """The format these options give ``linear`` (a float Linear, or its meta-device twin)."""
        return Fp8Format.for_linear(linear, weight_dtype=self.weight_dtype, granularity=self.granularity,
                                    activation_scheme=self.activation_scheme, activation_dtype=self.activation_dtype,
                                    activation_group_size=self.activation_group_size, input_shift=self.input_shift,
                                    outlier_channels=self.outlier_channels)


@register_pass
class Fp8Pass(Pass):
    """FP8 casts of decoder Linears (W8A8 or weight-only) and of the KV cache."""

    name = "fp8"
    Options = Fp8Options
    provides = frozenset({"fp8_weights", FP8_KV_CACHE})

    def __init__(self, options: Fp8Options):
        super().__init__(options)
        if options.kv_cache_dtype != "float8_e4m3fn":  # no scales an FP8 (E4M3) paged cache can store codes with
            self.provides = type(self).provides - {FP8_KV_CACHE}

    def _select(self, model: nn.Module) -> tuple[list[str], dict[str, str]]:
        """(the Linears to convert, {excluded Linear: the pattern naming it})."""
        if not self.options.convert_linears:
            return [], {}
        selected, excluded = select_linears(model, self.options.modules_to_not_convert)
        routers = set(router_names(model.config))
        return [n for n in selected if n not in routers], excluded

    def plan(self, model: Transformer) -> PassPlan:
        linears = linear_modules(model)
        return PassPlan({n: self.options.format_for(linears[n]).to_dict() for n in self._select(model)[0]})

    def check(self, model: Transformer) -> None:
        config = model.config
        if config.spec.attention == "mla" and self.options.kv_cache_dtype != "none":
            raise ConfigError(f"fp8 kv_cache_dtype is not supported for {config.architecture}: its cache holds MLA's "
                              "latent, which has no calibrated FP8 scales; use kv_cache_dtype = \"none\"")
        candidates = self._select(model)[0]
        outliers = self.options.outlier_channels
        for name in candidates if outliers else []:
            k = model.get_submodule(name).in_features
            if outliers >= k:
                raise ConfigError(f"outlier_channels {outliers} is not below {name}'s {k} input features; "
                                  "use a small fraction of them (e.g. 32)")
        group = self.options.activation_group_size
        for name in candidates if group else []:
            k = model.get_submodule(name).in_features
            if k % group:
                divisors = [g for g in range(16, k + 1, 16) if k % g == 0]
                raise ConfigError(f"activation_group_size {group} does not divide {name}'s {k} input features; "
                                  f"use one that divides every layer's (for {k}: {', '.join(map(str, divisors))})")

    def scope(self, model: Transformer) -> str:
        # A block at a time when every Linear it converts lies in a decoder block (lm_head's
        # input is the whole model's output), and no expert's calibration depends on its routing
        # (a mixture of experts' starved-expert policy runs a forward of its own: whole model).
        inside = all(n.startswith("layers.") for n in self._select(model)[0])
        return "block" if inside and not model.config.spec.is_moe else "model"

    def working_memory(self, model: Transformer, calibration, dtype_bytes: int, streamed: bool) -> dict[str, int]:
        o, config = self.options, model.config
        samples = o.calibration_samples or calibration.samples
        tokens, widths = samples * calibration.seq_len, linear_inputs(config)
        per_block = sum((k * k * 4 if o.weight_rounding == "gptq" else 0)
                        + (o.error_tokens * k * 4 if o.max_layer_error is not None else 0)
                        + (tokens * 4 if o.activation_scheme == "static" else 0) + 4 * k * 8 for k in widths)
        gptq = {"GPTQ factorisations": 4 * max(widths) ** 2 * 4} if o.weight_rounding == "gptq" else {}
        if streamed:
            return {**activation_terms(config, samples, calibration.seq_len, CALIBRATION_BATCH, dtype_bytes),
                    "calibration statistics (one block)": per_block, **gptq}
        chunk = min(CALIBRATION_BATCH, samples) * calibration.seq_len
        forward = chunk * (3 * config.intermediate_size + 6 * config.dim + 2 * config.vocab_size) * 4
        return {"calibration statistics (every block)": config.n_layers * per_block,
                "model forward (one batch)": forward + chunk * config.n_heads * calibration.seq_len * 4,
                "FP8 weights (every block)": converted_weights(model, 1), **gptq}

    def stream(self, model: Transformer, context: PassContext) -> "Fp8Stream":
        return Fp8Stream(self, model, context)

    def run(self, model: Transformer, context: PassContext) -> PassReport:
        candidates, excluded = self._select(model)
        stats = self._calibrate(model, context, candidates)
        routed = {n: stats.inputs[n].tokens for n in candidates if expert_of(n) is not None and n in stats.inputs}
        stats, starved = self._calibrate_starved(model, context, stats, candidates)
        rows, blocks = [], [name.split(".")[:2] for name in candidates]
        for i, name in enumerate(track(candidates, "fp8: quantizing layers")):
            rows.append(self._convert(model, name, stats.inputs.get(name), routed.get(name), starved.get(name)))
            if i + 1 == len(candidates) or blocks[i + 1] != blocks[i]:
                trim_heap()  # the block's conversion temporaries back to the kernel (see trim_heap)
        return self._report(model, context, excluded, rows, stats.kv, starved)

    def _report(self, model: Transformer, context: PassContext, excluded: dict[str, str], rows: list[LayerDecision],
                observers: list[KVObserver], starved: dict[str, str] | None = None) -> PassReport:
        """The report of converted ``rows`` (``starved``: the starved experts' Linears); with an FP8
        KV cache, its scales from ``observers`` installed and declared in the manifest."""
        o = self.options
        report = PassReport(self.name)
        report.layers = [LayerDecision(n, "float", f"modules_to_not_convert {p!r}") for n, p in excluded.items()]
        report.layers += [LayerDecision(n, "float", "router: stays in float") for n in router_names(model.config)
                          if o.convert_linears]
        report.layers += rows
        if model.config.spec.is_moe and o.convert_linears:
            report.metrics["experts_starved"] = sum(len(e) for e in experts_of(list(starved or {})).values())
        kept = [r.module for r in rows if r.format == "float"]
        report.metrics |= {"converted": len(rows) - len(kept), "fallback": len(kept),
                           "weight_dtype": o.weight_dtype, "activations": o.activation_scheme}
        if o.outlier_channels:
            report.metrics["outlier_channels"] = o.outlier_channels
        if kept:
            report.notes.append(f"{len(kept)} layer(s) stay in {model.embed_tokens.weight.dtype} because their "
                                f"relative error exceeds max_layer_error={o.max_layer_error}: {', '.join(kept)}")
        if excluded:
            report.notes.append(f"not converted (modules_to_not_convert): {', '.join(excluded)}")
        if o.kv_cache_dtype != "none":
            entry = kv_cache_entry(o.kv_cache_dtype, o.kv_cache_granularity, observers)
            install_kv_quant(model, entry)
            context.manifest_extras["kv_cache"] = entry
            report.metrics["kv_cache"] = f"{o.kv_cache_dtype} {o.kv_cache_granularity}"
        return report

    def _request(self) -> InputRequest:
        """What each converted Linear needs of its calibration inputs: the abs-maxima of every
        token (static scales), a row sample (the fallback's error), XᵀX (GPTQ), all of the input
        less its channel mean (``input_shift``), with the outlier channels left out of the maxima."""
        o = self.options
        return InputRequest(token_amax=o.activation_scheme == "static",
                            rows=o.error_tokens if o.max_layer_error is not None else 0,
                            gram="all" if o.weight_rounding == "gptq" else "none",
                            centre=o.input_shift, outlier_channels=o.outlier_channels)

    def _calibrate(self, model: Transformer, context: PassContext, candidates: list[str]) -> CalibrationStatistics:
        """The calibration statistics of every candidate (and, with an FP8 KV cache, each
        layer's K/V abs-max), through the context's shared collector; none when nothing needs them."""
        o = self.options
        request = self._request()
        requests = {n: request for n in candidates} if request != InputRequest() else {}
        if not requests:  # an expert's rows still report the tokens routed to it: count them
            requests = {n: InputRequest(mean_abs=True) for n in candidates if expert_of(n) is not None}
        kv = o.kv_cache_dtype != "none"
        if not requests and not kv:
            return CalibrationStatistics({}, [])
        windows = context.calibration_windows(o.calibration_samples)
        return context.input_statistics(model, windows, requests, kv_heads=kv, label="fp8: calibrating",
                                        batch_size=CALIBRATION_BATCH)

    def _calibrate_starved(self, model: Transformer, context: PassContext, stats: CalibrationStatistics,
                           candidates: list[str]) -> tuple[CalibrationStatistics, dict[str, str]]:
        """(the statistics, {starved expert Linear: the reason its rows give}); under "all_tokens"
        the starved experts' statistics are those of every token of their layer (a forward of its
        own; ``stats``, which the context may share, is left as it is)."""
        o = self.options
        names = starved_linears(stats.inputs, [n for n in candidates if n in stats.inputs], o.min_expert_tokens)
        if not names:
            return stats, {}
        layer_tokens = context.calibration_windows(o.calibration_samples).numel()
        reasons = {n: starved_reason(stats.inputs[n].tokens, layer_tokens, o.min_expert_tokens, o.starved_experts)
                   for n in names}
        if o.starved_experts == "all_tokens":
            request = self._request()
            if request != InputRequest():
                windows = context.calibration_windows(o.calibration_samples)
                with every_token_to(model, experts_of(names)):  # not through the cache: the routing is not the model's
                    extra = collect_model(model, windows, {n: request for n in names}, label="fp8: starved experts")
                if short := [n for n in names if extra.inputs[n].tokens != layer_tokens]:
                    raise RuntimeError(f"starved experts' linears {short} did not see every token of the layer")
                stats = CalibrationStatistics({**stats.inputs, **extra.inputs}, stats.kv)
        return stats, reasons

    def _input_scale(self, token_amax: torch.Tensor) -> float:
        o = self.options
        amax = token_amax.max() if o.static_calibration == "absmax" else torch.quantile(token_amax, o.percentile / 100)
        return float(amax) / fp8_max(FP8_DTYPES[o.activation_dtype])

    def _gptq_weight(self, linear: nn.Linear, hessian: torch.Tensor,
                     outliers: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """GPTQ-rounded weight on the FP8 grid of the original weight's abs-max scales (of the
        columns that are cast: ``outliers``' columns stay float, rounded last to take compensation)."""
        o = self.options
        dtype = FP8_DTYPES[o.weight_dtype]
        cast = linear.weight.detach() if outliers is None else linear.weight.detach().index_fill(1, outliers, 0)
        scale = weight_scale(cast, dtype, o.granularity)[:, None]
        weight = gptq_round(linear.weight, hessian, lambda cols, _: dequantize(quantize(cols, scale, dtype), scale),
                            damp=o.gptq_damp, exact=outliers)
        return weight, scale[:, 0]

    def _convert(self, model: Transformer, name: str, stats: InputStatistics | None,
                 routed: int | None = None, starved: str | None = None) -> LayerDecision:
        """Quantize one Linear; keep it in float if its error on calibration rows is too high.
        An expert's: ``routed`` tokens reached it; ``starved``, if it was starved, is the reason
        its row gives (under starved_experts = "float" it stays in float at once)."""
        o = self.options
        counts = {} if routed is None else {"expert_tokens": routed}
        if starved is not None and o.starved_experts == "all_tokens" and stats is not None:
            counts["calibration_tokens"] = stats.tokens
        if starved is not None and o.starved_experts == "float":
            return LayerDecision(name, "float", starved, counts)
        linear = model.get_submodule(name)
        fmt = o.format_for(linear)
        input_scale = self._input_scale(stats.token_amax) if fmt.static else None
        shift, outliers = (stats.shift, stats.outliers) if stats is not None else (None, None)
        weight = scale = None
        if o.weight_rounding == "gptq":
            weight, scale = self._gptq_weight(linear, stats.hessian, outliers)
        q = Fp8Linear.from_linear(linear, fmt, input_scale, weight, scale, shift, outliers)
        row = LayerDecision(name, "fp8", starved or "requested", counts)
        if input_scale is not None:
            row.metrics["input_scale"] = input_scale
        if o.max_layer_error is not None:
            with torch.inference_mode():
                x = stats.rows.to(linear.weight.dtype)
                ref = linear(x).float()
                err = float((q(x).float() - ref).norm() / ref.norm().clamp(min=1e-30))
                q.drop_float_weight()
            err = err if math.isfinite(err) else float("inf")
            row.metrics["output_error"] = err  # a fallback's too: the error FP8 would have added
            if err > o.max_layer_error:
                row.format = "float"
                row.reason = f"{starved + '; ' if starved else ''}relative error {err:.4f} > max_layer_error {o.max_layer_error}"
                return row
            row.reason = f"{starved + '; ' if starved else ''}relative error {err:.4f} <= max_layer_error {o.max_layer_error}"
        model.set_submodule(name, q)
        return row


class Fp8Stream(BlockStream):
    """The pass a block at a time (streamed compiles): each block's inputs are collected over the
    float block (``collect_block``) in the chunks of ``CALIBRATION_BATCH`` sequences the
    whole-model forward of ``Fp8Pass.run`` uses, so both give the same statistics and the same
    bytes; the conversion and the report are ``Fp8Pass``'s own."""

    @torch.inference_mode()
    def __init__(self, fp8: Fp8Pass, model: Transformer, context: PassContext):
        self.fp8, self.model, self.context = fp8, model, context
        self.candidates, self.excluded = fp8._select(model)
        self.request = fp8._request()
        self.kv = fp8.options.kv_cache_dtype != "none"
        self.rows: list[LayerDecision] = []
        self.observers: list[KVObserver] = []
        self.x = None
        if (self.candidates and self.request != InputRequest()) or self.kv:
            windows = context.calibration_windows(fp8.options.calibration_samples)
            self.x = model.embed_tokens(windows)  # [S, T, dim]
            self.positions = torch.arange(windows.shape[1]).expand(min(CALIBRATION_BATCH, len(windows)), -1)
            self.cos, self.sin = model.rope(self.positions, self.x.dtype)

    @torch.inference_mode()
    def block(self, index: int) -> None:
        prefix = f"layers.{index}."
        names = [n for n in self.candidates if n.startswith(prefix)]
        stats = self._collect(self.model.layers[index], [n[len(prefix):] for n in names])
        self.rows += [self.fp8._convert(self.model, n, stats.get(n[len(prefix):])) for n in names]

    def _collect(self, block: nn.Module, names: list[str]) -> dict[str, InputStatistics]:
        """The statistics of ``names`` (relative to ``block``), as ``collect_model`` gathers them:
        channel moments first where the request centres or drops outlier channels."""
        if self.x is None:
            return {}
        args = (block, self.x, self.cos, self.sin, self.positions)
        requests = {n: self.request for n in names} if self.request != InputRequest() else {}
        first = {n: InputRequest(moments=True) for n, r in requests.items() if r.needs_moments}
        moments = collect_block(*args, first)[1].inputs if first else None
        saved = block.self_attn.kv_quant
        observer = KVObserver() if self.kv else None
        if observer is not None:
            block.self_attn.kv_quant = observer
            self.observers.append(observer)
        try:
            self.x, stats = collect_block(*args, requests, moments=moments)
        finally:
            block.self_attn.kv_quant = saved
        return stats.inputs

    def finish(self) -> PassReport:
        self.x = None
        return self.fp8._report(self.model, self.context, self.excluded, self.rows, self.observers)
