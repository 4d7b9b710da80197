"""AWQ: activation-aware INT4 weight quantization (Lin et al., MLSys 2024).

Block by block over the decoder (memory: the calibration activations of one block), in memory or,
in a streamed compile (``compiler/pipeline/streaming.py``), with each block read from disk as it
comes (``AwqStream`` serves both):

1. capture: run the float block on every calibration sequence; its outputs become the next
   block's inputs; the calibration collector (``compiler.pipeline.calibration.collect_block``)
   records, for the input of each scaling group, mean |x| per channel over every token and the
   Gram matrix X^T X of a seeded token subsample (``search_tokens``).
2. scale search, per scaling group (input_layernorm → q/k/v, v → o, post_attention_layernorm
   → gate/up, up → down; see ``awq_plan.SCALING_GROUPS``): s = mean|x|^α / mean|ŵ|^(1-α)
   (AutoAWQ's duo scaling; s = mean|x|^α without it, and by default on up → down, see
   ``ScalingGroup.duo``) over the α grid. Every α is scored by the group's linear output error
   (Gram matrices, cheap); where the group feeds a larger module (q/k/v → self_attn, gate/up →
   mlp) the ``module_candidates`` best are re-scored on that module's output over
   ``module_sequences`` calibration sequences (the reference implementation's block-output
   criterion), and the best there is kept.
3. fold: the input columns of the group's linears are multiplied by s and ``prev``'s output
   (RMSNorm weight or Linear rows) divided by s — the float model is unchanged.
4. clip search per (row, group): the max-value shrink ratio minimising output error.
5. quantize (asymmetric INT4 with zero points, or symmetric) into ``Int4Linear``: the scales and
   zero points of the clipped groups, the codes by GPTQ's error-compensating rounding over the
   same Gram matrix (``weight_rounding = "gptq"``, the default; "nearest" is plain AWQ). A layer
   whose relative output error exceeds ``max_layer_error`` is retried with smaller groups.

The Gram loss (``awq_search``) makes a grid point one small matmul, not a forward pass over the
calibration set; the module forwards run only for the shortlist, on a few sequences. Example::

    [[passes]]
    name = "awq"
    group_size = 128
"""
from __future__ import annotations

from dataclasses import replace

import torch

from compiler.deploy.targets import get_target
from compiler.errors import ConfigError
from compiler.formats.int4 import Int4Linear
from compiler.pipeline import (
    BlockStream,
    LayerDecision,
    Pass,
    PassContext,
    PassReport,
    register_pass,
)
from compiler.pipeline.calibration import (
    InputRequest,
    InputStatistics,
    TokenSampler,
    collect_block,
)
from passes.awq_plan import (
    NO_CLIP,
    SCALING_GROUPS,
    AWQOptions,
    LayerPlan,
    ScalingGroup,
    awq_working_memory,
    plan_layers,
    smaller_groups,
)
from passes.awq_search import (
    quant_error,
    rank_scales,
    relative_error,
    search_clip,
    weight_mean,
)
from passes.gptq import gptq_int4


@register_pass
class AWQPass(Pass):
    """Activation-aware INT4 weight quantization; see the module docstring."""

    name = "awq"
    Options = AWQOptions
    requires = frozenset({"float_weights"})
    provides = frozenset({"int4_weights"})
    invalidates = frozenset({"float_weights"})

    def check(self, config):
        if config.architecture not in SCALING_GROUPS:
            raise ConfigError(f"awq has no scaling groups for {config.architecture}; supported: {', '.join(SCALING_GROUPS)}")
        plan_layers(config, self.options)

    def planned_formats(self, config):
        plans, _ = plan_layers(config, self.options)
        return {name: p.format(self.options.zero_point) for name, p in plans.items()}

    def scope(self, config):
        return "block"

    def working_memory(self, config, calibration, dtype_bytes, streamed):
        return awq_working_memory(config, calibration, self.options, dtype_bytes)

    def stream(self, model: torch.nn.Module, context: PassContext) -> "AwqStream":
        return AwqStream(self, model, context)

    @staticmethod
    def _capture(block, x, cos, sin, positions, sampler: TokenSampler):
        """Run the float block over every sequence; return its outputs and, per scaling group's
        first linear, mean |x| and the Gram matrix of the sampled tokens of its input."""
        groups = SCALING_GROUPS[block.self_attn.config.architecture]
        requests = {g.linears[0]: InputRequest(mean_abs=True, gram="sampled") for g in groups}
        out, stats = collect_block(block, x, cos, sin, positions, requests, sampler)
        return out, stats.inputs


class AwqStream(BlockStream):
    """The pass over one block at a time: the calibration inputs flow from block to block."""

    @torch.no_grad()
    def __init__(self, awq: AWQPass, model: torch.nn.Module, context: PassContext):
        self.awq, self.model, self.opts, self.target = awq, model, awq.options, context.target
        self.plans, excluded = plan_layers(model.config, self.opts)
        self.windows = context.calibration_windows()  # [S, T]
        self.report = PassReport(awq.name)
        self.report.layers += [LayerDecision(n, "float", f"modules_to_not_convert {p!r}") for n, p in excluded.items()]
        generator = torch.Generator().manual_seed(context.calibration.seed)
        self.sampler = TokenSampler(self.opts.search_tokens, self.windows.numel(), generator)
        self.x = model.embed_tokens(self.windows)  # [S, T, dim]
        self.positions = torch.arange(self.windows.shape[1]).expand(min(self.opts.batch_size, len(self.windows)), -1)
        self.cos, self.sin = model.rope(self.positions, self.x.dtype)
        self.k = min(self.opts.module_sequences, self.positions.shape[0])

    @torch.no_grad()
    def block(self, index: int) -> None:
        k, block = self.k, self.model.layers[index]
        sample = (self.x[:k], self.cos[:k], self.sin[:k], self.positions[:k])  # the block's float inputs, for module scoring
        self.x, stats = AWQPass._capture(block, self.x, self.cos, self.sin, self.positions, self.sampler)
        worker = BlockQuantizer(self.model, f"layers.{index}.", self.plans, self.opts, self.target)
        self.report.layers += worker.run(stats, sample)

    def finish(self) -> PassReport:
        opts, report = self.opts, self.report
        self.x = None  # the last block's outputs: nothing reads them
        report.metrics = _metrics(report.layers, self.windows, opts)
        scoring = (f"the best {opts.module_candidates} re-scored on self_attn / mlp outputs over {self.k} sequences"
                   if opts.module_candidates > 1 and self.k else "scored on the linears' own output error")
        report.notes.append(f"α grid of {opts.alpha_grid} (duo scaling {opts.duo_scaling}), "
                            f"{scoring}; clip search skips q_proj/k_proj (as llm-awq); "
                            f"{'GPTQ' if opts.weight_rounding == 'gptq' else 'round-to-nearest'} rounding")
        return report


class BlockQuantizer:
    """Scale search, folding, clip search and quantization of one decoder block."""

    def __init__(self, model, prefix: str, plans: dict[str, LayerPlan], opts: AWQOptions, target: str | None):
        self.model, self.prefix, self.plans, self.opts, self.target = model, prefix, plans, opts, target
        self.block = model.get_submodule(prefix.rstrip("."))
        self.config = model.config
        self.inspected: dict[str, tuple[tuple, torch.Tensor]] = {}  # set by run(); empty: Gram loss only

    def run(self, stats: dict[str, InputStatistics], sample: tuple) -> list[LayerDecision]:
        """Search, fold and quantize; return one report row per converted linear. ``sample``:
        block inputs (x, cos, sin, positions) of a few calibration sequences for module scoring."""
        self.inspected = self._inspect_modules(sample)
        rows, hessians = self.search_and_fold(stats)
        for name, row in rows.items():
            metrics, why = self._quantize(name, hessians[name])
            row.metrics.update(metrics)
            if why:
                row.reason = f"{row.reason}; {why}"
        return list(rows.values())

    def search_and_fold(self, stats: dict[str, InputStatistics]) -> tuple[dict[str, LayerDecision], dict[str, torch.Tensor]]:
        """Steps 2-3: the block's float function is unchanged; returns report rows and the
        Gram matrices of each linear's (now scaled) input."""
        groups = SCALING_GROUPS[self.config.architecture]
        rows: dict[str, LayerDecision] = {}
        hessians: dict[str, torch.Tensor] = {}
        searched = []
        # Search every group on the original block first (as llm-awq does), then fold all scales.
        for group in groups:
            st = stats[group.linears[0]]
            h = st.hessian
            for name in group.linears:
                hessians[name] = h
                if (plan := self.plans.get(self.prefix + name)) is not None:
                    w = self.block.get_submodule(name).weight.float()
                    rtn = relative_error(w, quant_error(w, plan.group_size, self.opts.zero_point), h)
                    rows[name] = LayerDecision(plan.name, "int4", plan.reason, {
                        "group_size": plan.group_size, "scale_group": _group_label(group), "rel_error_rtn": rtn})
            searched.append((group, self._search(group, st, h)))
        for group, found in searched:
            if found is None:
                continue
            s, s_cols, alpha = found
            self._fold(group, s, s_cols)
            for name in group.linears:
                hessians[name] = hessians[name] / torch.outer(s_cols, s_cols)
                if name in rows:
                    rows[name].metrics["alpha"] = alpha
        return rows, hessians

    def _inspect_modules(self, sample: tuple) -> dict[str, tuple[tuple, torch.Tensor]]:
        """Float (args, output) of each group's ``inspect`` module on the sample sequences."""
        names = {g.inspect for g in SCALING_GROUPS[self.config.architecture] if g.inspect}
        if self.opts.module_candidates < 2 or sample[0].shape[0] == 0:
            return {}
        seen, hooks = {}, []
        for name in names:
            hooks.append(self.block.get_submodule(name).register_forward_hook(
                lambda _m, args, out, name=name: seen.__setitem__(name, (args, out))))
        try:
            self.block(*sample)
        finally:
            for h in hooks:
                h.remove()
        return seen

    def _module_error(self, group: ScalingGroup, converted: list[str], s_cols: torch.Tensor) -> float:
        """Mean squared output error of ``group.inspect`` with the converted linears fake-quantized at scale s."""
        module = self.block.get_submodule(group.inspect)
        args, reference = self.inspected[group.inspect]
        saved = {}
        try:
            for name in converted:
                lin = self.block.get_submodule(name)
                saved[name] = lin.weight.data
                scaled = lin.weight.float() * s_cols
                g = self.plans[self.prefix + name].group_size
                lin.weight.data = ((scaled + quant_error(scaled, g, self.opts.zero_point)) / s_cols).to(lin.weight.dtype)
            return float((module(*args).float() - reference.float()).pow(2).mean())
        finally:
            for name, w in saved.items():
                self.block.get_submodule(name).weight.data = w

    def _expand(self, group: ScalingGroup) -> torch.Tensor | None:
        """Map from consumer input columns to ``prev``'s output channels (GQA: v → o), or None."""
        prev = self.block.get_submodule(group.prev)
        k = self.block.get_submodule(group.linears[0]).in_features
        c = prev.weight.shape[0]
        if c == k:
            return None
        hd, n_rep = self.config.head_dim, self.config.n_heads // self.config.n_kv_heads
        if c * n_rep != k or not isinstance(prev, torch.nn.Linear):
            raise ValueError(f"{self.prefix}{group.prev} ({c} outputs) cannot feed {group.linears[0]} ({k} inputs)")
        col = torch.arange(k)
        return (col // hd // n_rep) * hd + col % hd  # q head h reads kv head h // n_rep

    def _search(self, group: ScalingGroup, st: InputStatistics, h: torch.Tensor):
        converted = [n for n in group.linears if self.prefix + n in self.plans]
        if not converted:
            return None  # nothing quantized here: no reason to move the scales
        expand = self._expand(group)
        c = self.block.get_submodule(group.prev).weight.shape[0]
        to_channels = (lambda v: v) if expand is None else (lambda v: _average_by(v, expand, c))  # columns -> prev's channels
        to_columns = (lambda s: s) if expand is None else (lambda s: s[expand])  # and back
        mean = to_channels(st.mean_abs)
        w = torch.cat([self.block.get_submodule(n).weight.float() for n in converted])
        g = self.plans[self.prefix + converted[0]].group_size
        duo = self.opts.duo_scaling == "all" or self.opts.duo_scaling == "auto" and group.duo
        w_mean = to_channels(weight_mean(w, g)) if duo else None
        ranked = rank_scales(w, mean, h, g, self.opts.zero_point, self.opts.alpha_grid, expand, w_mean)
        if group.inspect in self.inspected:  # the Gram loss shortlists, the module's output decides
            shortlist = ranked[: self.opts.module_candidates]
            ranked = sorted(((self._module_error(group, converted, to_columns(s)), a, s) for _, a, s in shortlist),
                            key=lambda r: r[0])
        _, alpha, s = ranked[0]
        return s, to_columns(s), alpha

    def _fold(self, group: ScalingGroup, s: torch.Tensor, s_cols: torch.Tensor) -> None:
        """x' = x / s at ``prev``'s output, W' = W * s on the consumers' columns."""
        prev = self.block.get_submodule(group.prev)
        if isinstance(prev, torch.nn.Linear):
            prev.weight.div_(s.to(prev.weight.dtype)[:, None])
            if prev.bias is not None:
                prev.bias.div_(s.to(prev.bias.dtype))
        else:  # RMSNorm: y = weight * normalised(x)
            prev.weight.div_(s.to(prev.weight.dtype))
        for name in group.linears:
            lin = self.block.get_submodule(name)
            lin.weight.mul_(s_cols.to(lin.weight.dtype)[None, :])

    def _quantize(self, name: str, h: torch.Tensor) -> tuple[dict, str | None]:
        """Clip-search and quantize one (already scaled) linear; retry smaller groups if too lossy.
        Returns the row's metrics and what ``max_layer_error`` made of it (None: nothing)."""
        plan, opts = self.plans[self.prefix + name], self.opts
        linear = self.block.get_submodule(name)
        w = linear.weight.float()
        g, why = plan.group_size, None
        while True:
            clip = (search_clip(w, h, g, opts.zero_point, opts.clip_grid, opts.max_shrink)
                    if opts.clip_search and name not in NO_CLIP else torch.ones(1))
            if opts.weight_rounding == "gptq":
                q = gptq_int4(linear, h, g, opts.zero_point, clip, opts.gptq_damp)
            else:
                q = Int4Linear.from_float(linear, g, opts.zero_point, clip)
            err = relative_error(w, q.dequantized_weight().float() - w, h)
            if opts.max_layer_error is None or err <= opts.max_layer_error:
                break
            retry = [g2 for g2 in smaller_groups(plan.in_features, g, opts.group_size_policy) if self._target_accepts(plan, g2)]
            if not retry:
                why = f"relative error {err:.4f} > max_layer_error {opts.max_layer_error} at g{g}; no smaller group size left"
                break
            why = f"max_layer_error: relative error {err:.4f} > {opts.max_layer_error} at g{g}, retried with g{retry[0]}"
            g = retry[0]
        self.block.set_submodule(name, q)
        return {"group_size": g, "clip_ratio": round(float(clip.mean()), 4), "rel_error_awq": err}, why

    def _target_accepts(self, plan: LayerPlan, g: int) -> bool:
        if self.target is None:
            return True
        return get_target(self.target).check(plan.name, replace(plan, group_size=g).format(self.opts.zero_point)) is None


def _average_by(values: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Mean of ``values`` [K] over the columns ``index`` [K] maps to each of n channels."""
    return torch.zeros(n).index_add_(0, index, values) / torch.bincount(index, minlength=n)


def _group_label(group: ScalingGroup) -> str:
    return f"{group.prev} → {', '.join(n.rpartition('.')[2] for n in group.linears)}"


def _metrics(layers: list[LayerDecision], windows: torch.Tensor, opts: AWQOptions) -> dict:
    quantized = [r.metrics for r in layers if r.format == "int4"]
    mean = lambda key: sum(r[key] for r in quantized) / max(len(quantized), 1)  # noqa: E731
    sizes: dict[str, int] = {}
    for r in quantized:
        sizes[f"g{r['group_size']}"] = sizes.get(f"g{r['group_size']}", 0) + 1
    return {"layers_int4": len(quantized), "layers_float": len(layers) - len(quantized),
            "group_sizes": ", ".join(f"{k}: {v}" for k, v in sorted(sizes.items())),
            "mean_rel_error_rtn": mean("rel_error_rtn"), "mean_rel_error_awq": mean("rel_error_awq"),
            "calibration_tokens": windows.numel(), "search_tokens_per_block": min(opts.search_tokens, windows.numel())}
