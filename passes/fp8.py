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

Phases: (1) run the calibration windows through the model in its dtype, hooks recording for
each candidate Linear the abs-max of every input token, a sample of input rows and (GPTQ) the
Gram matrix XᵀX of its inputs, and for each attention layer the per-head K/V abs-max (with
``input_shift`` or ``outlier_channels``, a pass before it records each input channel's mean and
mean square: the abs-maxima and XᵀX are then of the inputs less that mean, and the outlier
channels are those of largest mean square of what would be cast);
(2) quantize each candidate (GPTQ: each weight column in turn, its rounding error pushed onto
the columns not yet rounded; weight scales stay the abs-max ones), measure its relative
output error on the sampled rows and keep it in float if that exceeds ``max_layer_error`` (a
recorded decision, never silent); (3) install the FP8 KV rounding and record its scales in the
manifest's ``kv_cache`` entry for the engine. Formats and buffers: ``compiler/formats/fp8.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Literal

import torch
import torch.nn as nn

from compiler.errors import ConfigError
from compiler.formats.fp8 import Fp8Linear
from compiler.formats.fp8_kv import KVObserver, install_kv_quant, kv_cache_entry
from compiler.formats.qlinear import linear_modules
from compiler.model.config import ModelConfig
from compiler.model.transformer import Transformer
from compiler.pipeline import Pass, PassContext, PassReport, register_pass
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
    # On SmolLM2 it cuts the KL to float by 19% (dynamic) and 30% (static); see docs/BENCHMARKS.md.
    input_shift: bool = True
    # Keep this many input channels of each Linear (those of largest calibrated mean square, after
    # the shift) out of the FP8 cast, in the model dtype, with their weight columns (QUIK). On
    # SmolLM2, 32 of 576 cut the W8A8 KL to float by a third; see docs/BENCHMARKS.md.
    outlier_channels: int = 0
    # Static scales: "absmax" covers every calibration token; "percentile" covers that percentile
    # of the tokens' abs-maxima (the rest saturate), trading rare outliers for finer steps.
    static_calibration: Literal["absmax", "percentile"] = "absmax"
    percentile: float = 99.9
    # A pattern names a module by a glob over its full name or by dotted components ("lm_head", "layers.0").
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
        if self.activation_group_size < 0 or self.activation_group_size % 16:
            raise ValueError("activation_group_size must be 0 or a positive multiple of 16, "
                             f"got {self.activation_group_size}")
        if self.activation_group_size and self.activation_scheme != "dynamic":
            raise ValueError("activation_group_size needs activation_scheme = \"dynamic\", "
                             f"not {self.activation_scheme!r}")
        if not self.convert_linears and self.kv_cache_dtype == "none":
            raise ValueError("convert_linears = false with kv_cache_dtype = \"none\" converts nothing; "
                             "set a kv_cache_dtype or drop convert_linears")


def matches(name: str, pattern: str) -> bool:
    """Whether module ``name`` is named by ``pattern`` (a glob, or whole dotted components)."""
    return fnmatchcase(name, pattern) or f".{pattern}." in f".{name}."


def _meta_model(config: ModelConfig) -> Transformer:
    with torch.device("meta"):
        return Transformer(config)


@register_pass
class Fp8Pass(Pass):
    """FP8 casts of decoder Linears (W8A8 or weight-only) and of the KV cache."""

    name = "fp8"
    Options = Fp8Options
    provides = frozenset({"fp8_weights"})

    def _candidates(self, model: nn.Module) -> list[str]:
        if not self.options.convert_linears:
            return []
        return [n for n in linear_modules(model) if not any(matches(n, p) for p in self.options.modules_to_not_convert)]

    def _format(self, in_features: int, out_features: int) -> dict:
        o = self.options
        with torch.device("meta"):  # only the entry is wanted: allocate no buffers
            return Fp8Linear(in_features, out_features, False, torch.float32, o.weight_dtype, o.granularity,
                             o.activation_dtype, o.activation_scheme, o.activation_group_size,
                             o.input_shift, o.outlier_channels).format_meta()

    def planned_formats(self, config: ModelConfig) -> dict[str, dict]:
        model = _meta_model(config)
        linears = linear_modules(model)
        return {n: self._format(linears[n].in_features, linears[n].out_features) for n in self._candidates(model)}

    def check(self, config: ModelConfig) -> None:
        if config.spec.is_moe:  # its router would be cast and its experts calibrated on the whole token count
            raise ConfigError(f"fp8 cannot quantize {config.architecture} yet: mixture-of-experts needs a float router "
                              "and per-expert calibration; use a dense architecture")
        model = _meta_model(config)
        names = [n for n, _ in model.named_modules() if n]
        for p in self.options.modules_to_not_convert:
            if not any(matches(n, p) for n in names):
                raise ConfigError(f"modules_to_not_convert pattern {p!r} matches no module (e.g. {names[-1]!r}); fix or remove it")
        outliers = self.options.outlier_channels
        for name in self._candidates(model) if outliers else []:
            k = model.get_submodule(name).in_features
            if outliers >= k:
                raise ConfigError(f"outlier_channels {outliers} is not below {name}'s {k} input features; "
                                  "use a small fraction of them (e.g. 32)")
        group = self.options.activation_group_size
        for name in self._candidates(model) if group else []:
            k = model.get_submodule(name).in_features
            if k % group:
                divisors = [g for g in range(16, k + 1, 16) if k % g == 0]
                raise ConfigError(f"activation_group_size {group} does not divide {name}'s {k} input features; "
                                  f"use one that divides every layer's (for {k}: {', '.join(map(str, divisors))})")

    def run(self, model: Transformer, context: PassContext) -> PassReport:
        o = self.options
        report = PassReport(self.name)
        candidates = self._candidates(model)
        excluded = [n for n in linear_modules(model) if n not in set(candidates)]
        stats = self._calibrate(model, context, candidates)
        for name in track(candidates, "fp8: quantizing layers"):
            report.layers.append(self._convert(model, name, stats.get(name)))
        kept = [r["module"] for r in report.layers if r["decision"] == "fallback"]
        errors = [r["rel_error"] for r in report.layers if "rel_error" in r]
        report.metrics = {"converted": len(candidates) - len(kept), "fallback": len(kept),
                          "weight_dtype": o.weight_dtype, "activations": o.activation_scheme}
        if o.outlier_channels:
            report.metrics["outlier_channels"] = o.outlier_channels
        if errors:
            report.metrics |= {"mean_rel_error": sum(errors) / len(errors), "max_rel_error": max(errors)}
        if kept:
            report.notes.append(f"{len(kept)} layer(s) stay in {model.embed_tokens.weight.dtype} because their "
                                f"relative error exceeds max_layer_error={o.max_layer_error}: {', '.join(kept)}")
        if excluded and o.convert_linears:
            report.notes.append(f"not converted (modules_to_not_convert): {', '.join(excluded)}")
        if o.kv_cache_dtype != "none":
            entry = kv_cache_entry(o.kv_cache_dtype, o.kv_cache_granularity, stats["__kv__"])
            install_kv_quant(model, entry)
            context.manifest_extras["kv_cache"] = entry
            report.metrics["kv_cache"] = f"{o.kv_cache_dtype} {o.kv_cache_granularity}"
        return report

    def _needs_calibration(self, candidates: list[str]) -> bool:
        o = self.options
        return o.kv_cache_dtype != "none" or bool(candidates) and (
            o.activation_scheme == "static" or o.max_layer_error is not None or o.weight_rounding == "gptq"
            or o.input_shift or o.outlier_channels > 0)

    @staticmethod
    def _run_windows(model: Transformer, windows: torch.Tensor, label: str) -> None:
        device = next(model.parameters()).device
        batches = windows.split(4)
        for batch in track(batches, label, total=len(batches)):
            model(batch.to(device))

    @torch.inference_mode()
    def _input_moments(self, model: Transformer, windows: torch.Tensor,
                       candidates: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """name -> each input channel's mean and mean square over the calibration tokens ([in] float64)."""
        sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        def hook(name):
            def record(_module, args):
                x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
                s1, s2 = sums.get(name, (0, 0))
                sums[name] = (s1 + x.sum(0), s2 + x.square().sum(0))
            return record

        handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in candidates]
        try:
            self._run_windows(model, windows, "fp8: input statistics")
        finally:
            for h in handles:
                h.remove()
        return {n: (s1 / windows.numel(), s2 / windows.numel()) for n, (s1, s2) in sums.items()}

    def _shifts_and_outliers(self, model: Transformer, windows: torch.Tensor, candidates: list[str]
                             ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """name -> input_shift [in] float32 (with ``input_shift``), and name -> the indices of the
        ``outlier_channels`` channels of largest mean square once shifted (variance with the shift)."""
        o = self.options
        if not candidates or not (o.input_shift or o.outlier_channels):
            return {}, {}
        moments = self._input_moments(model, windows, candidates)
        shifts = {n: mean.float() for n, (mean, _) in moments.items()} if o.input_shift else {}
        outliers = {}
        for n, (mean, square) in moments.items() if o.outlier_channels else ():
            cast_square = square - mean.square() if o.input_shift else square
            outliers[n] = cast_square.topk(o.outlier_channels).indices.sort().values
        return shifts, outliers

    @torch.inference_mode()
    def _calibrate(self, model: Transformer, context: PassContext, candidates: list[str]) -> dict:
        """name -> {"token_amax": [N], "rows": [R, in], "hessian": [in, in] (gptq), "shift": [in]
        (input_shift), "outliers": [r] (outlier_channels)} per candidate; "__kv__" -> observers. With
        input_shift the abs-maxima and the Hessian are those of the shifted inputs, the rows (for
        the fallback's error) the raw ones; the abs-maxima leave the outlier channels out."""
        if not self._needs_calibration(candidates):
            return {}
        o = self.options
        windows = context.calibration_windows(o.calibration_samples)
        shifts, outliers = self._shifts_and_outliers(model, windows, candidates)
        stride = max(1, windows.numel() // o.error_tokens)  # every stride-th token is kept for errors
        stats = {n: {"token_amax": [], "rows": []} for n in candidates}
        # GPTQ's Hessians: q/k/v (and gate/up) read one tensor, so they share one running XᵀX.
        hessians: dict[str, torch.Tensor] = {}  # first reader's name -> sum of XᵀX
        owner: dict[str, str] = {}  # candidate -> the first reader of its input
        last = {"x": None, "name": None}

        def hook(name):
            def record(_module, args):
                x = args[0].detach().reshape(-1, args[0].shape[-1])  # [B*T, in]
                stats[name]["rows"].append(x[::stride].float().clone())
                xf = x.float() - shifts[name] if shifts else x.float()
                magnitude = xf.abs()  # a new tensor: the outlier channels can be zeroed in place
                if outliers:
                    magnitude.index_fill_(1, outliers[name], 0)
                stats[name]["token_amax"].append(magnitude.amax(-1))
                if o.weight_rounding == "gptq":
                    if args[0] is not last["x"]:  # `is`, and holding it, so no id is ever reused
                        last.update(x=args[0], name=name)
                        hessians[name] = hessians.get(name, 0) + xf.T @ xf
                    owner[name] = last["name"]
            return record

        handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in candidates]
        observers = [KVObserver() for _ in model.layers] if o.kv_cache_dtype != "none" else []
        saved = [layer.self_attn.kv_quant for layer in model.layers]
        for layer, obs in zip(model.layers, observers):
            layer.self_attn.kv_quant = obs
        try:
            self._run_windows(model, windows, "fp8: calibrating")
        finally:
            for h in handles:
                h.remove()
            for layer, prev in zip(model.layers, saved):
                layer.self_attn.kv_quant = prev
        last.clear()
        out = {n: {"token_amax": torch.cat(s["token_amax"]), "rows": torch.cat(s["rows"])[: o.error_tokens]}
               for n, s in stats.items()}
        for h in hessians.values():  # H = XᵀX / T (every Linear sees every calibration token)
            h.div_(windows.numel())
        for n in owner:  # readers of one input share one tensor
            out[n]["hessian"] = hessians[owner[n]]
        for n, shift in shifts.items():
            out[n]["shift"] = shift
        for n, index in outliers.items():
            out[n]["outliers"] = index
        out["__kv__"] = observers
        return out

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

    def _convert(self, model: Transformer, name: str, stats: dict | None) -> dict:
        """Quantize one Linear; keep it in float if its error on calibration rows is too high."""
        o = self.options
        linear = model.get_submodule(name)
        input_scale = self._input_scale(stats["token_amax"]) if o.activation_scheme == "static" else None
        outliers = (stats or {}).get("outliers")
        weight = scale = None
        if o.weight_rounding == "gptq":
            weight, scale = self._gptq_weight(linear, stats["hessian"], outliers)
        q = Fp8Linear.from_linear(linear, o.weight_dtype, o.granularity, o.activation_dtype, o.activation_scheme,
                                  input_scale, weight, scale, o.activation_group_size, (stats or {}).get("shift"),
                                  outliers)
        row = {"module": name, "decision": "fp8"}
        if input_scale is not None:
            row["input_scale"] = input_scale
        if stats is not None and o.max_layer_error is not None:
            with torch.inference_mode():
                x = stats["rows"].to(linear.weight.dtype)
                ref = linear(x).float()
                err = float((q(x).float() - ref).norm() / ref.norm().clamp(min=1e-30))
            row["rel_error"] = err if math.isfinite(err) else float("inf")
            if row["rel_error"] > o.max_layer_error:
                row["decision"] = "fallback"
                return row
        model.set_submodule(name, q)
        return row
