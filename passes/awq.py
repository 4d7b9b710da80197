"""AWQ: activation-aware INT4 weight quantization (Lin et al., MLSys 2024).

Block by block over the decoder (memory: the calibration activations of one block), in memory or,
in a streamed compile (``compiler/pipeline/streaming.py``), with each block read from disk as it
comes (``AwqStream`` serves both):

1. capture: run the float block on every calibration sequence; its outputs become the next
   block's inputs; the calibration collector (``compiler.pipeline.calibration.collect_block``)
   records, for the input of each scaling group, mean |x| per channel over every token and the
   Gram matrix X^T X of a seeded token subsample (``search_tokens``).
2. scale search, per scaling group (input_layernorm → q/k/v, v → o, the MLP's input norm →
   gate/up, up → down, per architecture and per expert: ``awq_mappings.SMOOTHING``), s = mean|x|^α / mean|ŵ|^(1-α)
   (AutoAWQ's duo scaling; s = mean|x|^α without it, and by default on up → down, see
   ``ScalingGroup.duo``) over the α grid. Every α is scored by the group's linear output error
   (Gram matrices, cheap); where the group feeds a larger module (q/k/v → self_attn, gate/up →
   mlp) the ``module_candidates`` best are re-scored on that module's output over
   ``module_sequences`` calibration sequences (the reference implementation's block-output
   criterion), and the best there is kept. Where a group's linears read different tokens (an MoE
   norm's experts), the Gram loss is each expert's on its own tokens, weighted by their number.
3. fold: the input columns of the group's linears are multiplied by s and ``prev``'s output
   (RMSNorm weight or Linear rows) divided by s — the float model is unchanged.
4. clip search per (row, group): the max-value shrink ratio minimising output error.
5. quantize (asymmetric INT4 with zero points, or symmetric) into ``Int4Linear``: the scales and
   zero points of the clipped groups, the codes by GPTQ's error-compensating rounding over the
   same Gram matrix (``weight_rounding = "gptq"``, the default; "nearest" is plain AWQ), the scales
   then re-fit to those codes with ``scale_refit``. A layer whose relative output error (its row's
   ``output_error``) exceeds ``max_layer_error`` is retried with smaller groups.

Bits by sensitivity: ``format = "gguf:q4_k_m"`` (Q6_K) and ``average_bits`` (INT8 W8A16) also
quantize every layer on a wider grid, and after the last block give it to the layers (units:
``sensitivity_unit``) whose output error it lowers most per extra bit, within a budget
(``AwqStream.upgrade_sensitive``); ``sensitivity = "kl"`` then measures each layer's end-to-end
KL alone (``AwqStream.measure_kl_alone``). The options: ``passes/awq_plan.py``.

``lm_head`` stays in float by default (``modules_to_not_convert``). Let through, it is the last
scaling group (final norm → lm_head) on the last block's outputs, after every block; a head tied
to the embedding is untied first (the embedding keeps its float rows for the lookup).

MoE layers: each expert's statistics are of the tokens routed to it, its report rows give their
number (``expert_tokens``), a starved expert gets ``starved_experts``' policy
(``passes/moe_calibration.py``), and the router stays in float (its columns take the norm's scale).

The Gram loss (``awq_search``) makes a grid point one small matmul, not a forward pass over the
calibration set; the module forwards run only for the shortlist, on a few sequences. Example::

    [[passes]]
    name = "awq"
    group_size = 128
"""
from __future__ import annotations

import copy
import re
from collections import defaultdict
from dataclasses import dataclass, replace

import torch

from compiler.deploy.targets import get_target
from compiler.errors import ConfigError
from compiler.formats.gguf_block import GgufLinear
from compiler.formats.int4 import Int4Linear
from compiler.model.fusion import fused_unit
from compiler.model.moe import every_token_to, router_names
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
from compiler.pipeline.memory import converted_weights
from compiler.pipeline.selection import meta_model
from compiler.progress import track
from passes.awq_mappings import (
    NO_CLIP,
    SMOOTHING,
    ScalingGroup,
    expand_columns,
    fold_scales,
    layer_groups,
)
from passes.awq_grid import GgufGrid, Int8Grid, grid_of
from passes.awq_plan import (
    AWQOptions,
    AwqPlan,
    LayerPlan,
    awq_working_memory,
    compact_names,
    plan_layers,
    q4_k_m_budget,
    smaller_groups,
    wider_format,
    wider_type,
)
from passes.awq_search import (
    quant_error,
    rank_scales,
    relative_error,
    search_clip,
    weight_mean,
)
from passes.distill.evaluate import compare_on_windows, teacher_logits
from passes.moe_calibration import expert_of, experts_of, starved_linears, starved_reason


@register_pass
class AWQPass(Pass):
    """Activation-aware INT4 weight quantization; see the module docstring."""

    name = "awq"
    Options = AWQOptions
    requires = frozenset({"float_weights"})
    provides = frozenset({"int4_weights"})
    invalidates = frozenset({"float_weights"})

    def check(self, model):
        if (architecture := model.config.architecture) not in SMOOTHING:
            raise ConfigError(f"awq has no scaling groups for {architecture}; supported: {', '.join(SMOOTHING)}")

    def plan(self, model) -> AwqPlan:
        layers, excluded = plan_layers(model, self.options)
        formats = {name: p.format(self.options.zero_point) for name, p in layers.items()}
        alternatives = {name: wide for name, p in layers.items() if (wide := wider_format(self.options, p))}
        return AwqPlan(formats, alternatives, layers=layers, excluded=excluded)

    def scope(self, model):
        # q4_k_m's and average_bits' wider layers are chosen over the whole model after the last block, and the
        # KL of a layer alone needs the whole float model: not one block at a time
        return "model" if spends_bits(self.options) or self.options.sensitivity == "kl" else "block"

    def working_memory(self, model, calibration, dtype_bytes, streamed):
        config = model.config
        terms = awq_working_memory(config, calibration, self.options, dtype_bytes)
        if streamed:
            return terms
        if self.options.format == "int4":  # 4-bit codes, and a scale and a zero point per group
            terms["INT4 weights (every block)"] = converted_weights(model, 0.5 + (dtype_bytes + 1) / self.options.group_size)
        else:  # a byte per code and a float16 scale per 16-32 weights; q4_k_m also keeps each layer's Q6_K candidate
            candidates = 2 if self.options.format == "gguf:q4_k_m" else 1
            terms["GGUF block codes (every block)"] = converted_weights(model, candidates * (1 + 2 / 16))
        if self.options.average_bits is not None:
            terms["INT8 candidates (every block)"] = converted_weights(model, 1)
        if self.options.sensitivity == "kl":
            head = config.vocab_size * config.dim * (1 if config.tie_embeddings else 2)
            terms["float copy of the model (sensitivity \"kl\")"] = converted_weights(model, dtype_bytes) + head * dtype_bytes
        return terms

    def stream(self, model: torch.nn.Module, context: PassContext) -> "AwqStream":
        return AwqStream(self, model, context)


def capture(block, groups: tuple[ScalingGroup, ...], x, cos, sin, positions, sampler: TokenSampler):
    """Run the float block over every sequence; return its outputs and, per linear of a
    scaling group, mean |x| and the Gram matrix of the sampled tokens of its input (linears
    reading one tensor share one set; an expert's are of the tokens routed to it)."""
    requests = {n: InputRequest(mean_abs=True, gram="sampled") for g in groups for n in g.linears}
    out, stats = collect_block(block, x, cos, sin, positions, requests, sampler)
    return out, stats.inputs


def capture_on_every_token(block, names: list[str], x, cos, sin, positions, sampler: TokenSampler):
    """Statistics of the starved experts' ``names``, with every token of the layer routed to them."""
    requests = {n: InputRequest(mean_abs=True, gram="sampled") for n in names}
    with every_token_to(block, experts_of(names)):
        _, stats = collect_block(block, x, cos, sin, positions, requests, sampler)
    if short := [n for n in names if stats.inputs[n].tokens != x.shape[0] * x.shape[1]]:
        raise RuntimeError(f"starved experts' linears {short} did not see every token of the layer")
    return stats.inputs


# The model's head as a scaling group: only lm_head reads the final norm's output.
HEAD_GROUP = ScalingGroup("norm", ("lm_head",))


def spends_bits(opts: AWQOptions) -> bool:
    """Whether some layers get a wider grid by measured sensitivity (``upgrade_sensitive``)."""
    return opts.format == "gguf:q4_k_m" or opts.average_bits is not None


def sensitivity_unit(name: str, opts: AWQOptions) -> str:
    """The layers that get the wider grid together: with ``average_bits`` what vLLM and the engine run as
    one layer (a block's q/k/v, its gate/up, a MoE layer's experts: one scheme each); q4_k_m's Q6_K is
    per tensor, as llama.cpp's recipe."""
    return name if opts.average_bits is None else fused_unit(name)


def stored_bits(module: torch.nn.Module) -> float:
    """The bits a converted layer takes where it is deployed: a GGUF block type's in the file, else its
    buffers as the artifact stores them (``qcompile inspect``'s bits per weight)."""
    if isinstance(module, GgufLinear):
        return module.type.bits * module.codes.numel()
    return 8.0 * sum(t.numel() * t.element_size() for t in module.state_dict().values())


@dataclass
class Candidate:
    """A layer's wider-grid module, kept until ``upgrade_sensitive`` decides."""

    name: str
    row: LayerDecision
    module: torch.nn.Module
    clip: torch.Tensor
    error: float
    extra_bits: float  # over the module the layer holds now


class AwqStream(BlockStream):
    """The pass over one block at a time: the calibration inputs flow from block to block."""

    @torch.no_grad()
    def __init__(self, awq: AWQPass, model: torch.nn.Module, context: PassContext):
        self.model, self.opts, self.target = model, awq.options, context.target
        # The plan validate made; run outside a compile, the pass plans here, on the model's meta-device twin.
        plan = context.plan_of(awq) or awq.plan(meta_model(model.config))
        self.plans, excluded = plan.layers, plan.excluded
        self.weights = sum(p.in_features * p.out_features for p in self.plans.values())  # of the converted layers
        self.windows = context.calibration_windows()  # [S, T]
        self.report = PassReport(awq.name)
        self.report.layers += [LayerDecision(n, "float", f"modules_to_not_convert {p!r}") for n, p in excluded.items()]
        self.report.layers += [LayerDecision(n, "float", "router: stays in float (its columns take the norm's scale)")
                               for n in router_names(model.config)]
        generator = torch.Generator().manual_seed(context.calibration.seed)
        self.sampler = TokenSampler(self.opts.search_tokens, self.windows.numel(), generator)
        self.x = model.embed_tokens(self.windows)  # [S, T, dim]
        self.positions = torch.arange(self.windows.shape[1]).expand(min(self.opts.batch_size, len(self.windows)), -1)
        self.cos, self.sin = model.rope(self.positions, self.x.dtype)
        self.k = min(self.opts.module_sequences, self.positions.shape[0])
        self.starved = 0
        self.wider: list[Candidate] = []  # q4_k_m's Q6_K, average_bits' INT8
        self.context = context
        self.reference = copy.deepcopy(model) if self.opts.sensitivity == "kl" else None  # folded float, block by block
        self.validation: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # windows, float logits: sensitivity "kl"
        if self.opts.average_bits is not None:
            self._check_average_bits()

    @torch.no_grad()
    def block(self, index: int) -> None:
        k, block, rope = self.k, self.model.layers[index], (self.cos, self.sin, self.positions)
        groups = layer_groups(self.model.config, index)
        sample = (self.x[:k], self.cos[:k], self.sin[:k], self.positions[:k])  # the block's float inputs, for module scoring
        block_inputs = self.x
        self.x, stats = capture(block, groups, self.x, *rope, self.sampler)
        worker = BlockQuantizer(self.model, f"layers.{index}.", self.plans, self.opts, self.target, groups)
        worker.on_folded = lambda: self._keep_float(f"layers.{index}")
        worker.count_experts(stats, self.windows.numel())
        if worker.starved and self.opts.starved_experts == "all_tokens":
            stats |= capture_on_every_token(block, worker.starved, block_inputs, *rope, self.sampler)
        self.starved += sum(len(experts) for experts in experts_of(worker.starved).values())
        rows = worker.run(stats, sample)
        self.report.layers += rows
        self._keep_candidates(worker, rows)

    def _keep_candidates(self, worker: "BlockQuantizer", rows: list[LayerDecision]) -> None:
        by_name = {row.module: row for row in rows}
        for n, (module, clip, err) in worker.wider.items():
            name = worker.prefix + n
            extra = stored_bits(module) - stored_bits(self.model.get_submodule(name))
            self.wider.append(Candidate(name, by_name[name], module, clip, err, extra))

    def _keep_float(self, *names: str) -> None:
        """``sensitivity = "kl"``: the float modules with AWQ's scales folded in, for the float model."""
        if self.reference is not None:
            for name in names:
                self.reference.set_submodule(name, copy.deepcopy(self.model.get_submodule(name)))

    @torch.no_grad()
    def quantize_head(self) -> None:
        """Steps 1-5 for the final norm → lm_head group, on the last block's outputs."""
        model, head = self.model, HEAD_GROUP.linears[0]
        model.untie_lm_head()
        stats = InputStatistics(InputRequest(mean_abs=True, gram="sampled"), model.config.dim)
        for chunk in self.x.split(self.positions.shape[0]):
            stats.add(model.norm(chunk), self.sampler.draw(chunk.shape[0] * chunk.shape[1]))
        worker = BlockQuantizer(model, "", {head: self.plans[head]}, self.opts, self.target, (HEAD_GROUP,))
        worker.on_folded = lambda: self._keep_float(*HEAD_GROUP.linears, HEAD_GROUP.prev)
        rows = worker.run({head: stats}, None)
        self.report.layers += rows
        self._keep_candidates(worker, rows)

    def _check_average_bits(self) -> None:
        """Refuse, before any work, an ``average_bits`` below what the INT4 layers alone take."""
        floor = self.average_bits(int4_only=True)
        if self.opts.average_bits < floor:
            raise ConfigError(f"awq: average_bits {self.opts.average_bits} is below the {floor:.3f} bits per weight "
                              f"INT4 g{self.opts.group_size} takes on this model (scales and zero points included); "
                              "raise it or use a larger group_size")

    def average_bits(self, int4_only: bool = False) -> float:
        """Bits per weight over the converted layers as they stand (``int4_only``: as planned, all INT4)."""
        bits = 0.0
        for name, plan in self.plans.items():
            module = self.model.get_submodule(name)
            if int4_only:
                with torch.device("meta"):
                    module = Int4Linear.empty(plan.format(self.opts.zero_point), plan.in_features, plan.out_features,
                                              module.bias is not None, self.model.embed_tokens.weight.dtype)
            bits += stored_bits(module)
        return bits / self.weights

    def upgrade_sensitive(self) -> str:
        """Give the wider grid (q4_k_m: Q6_K; average_bits: INT8 W8A16) to the units (``sensitivity_unit``)
        whose relative output error it lowers most per extra bit, greedily, while the budget lasts: the
        extra bits llama.cpp's Q4_K_M recipe spends on this model, or what ``average_bits`` leaves."""
        units: dict[str, list[Candidate]] = defaultdict(list)
        for c in self.wider:
            units[sensitivity_unit(c.name, self.opts)].append(c)
        members = defaultdict(int)
        for name in self.plans:
            members[sensitivity_unit(name, self.opts)] += 1
        # a unit some member has no candidate for (an expert rounded RTN) stays as it is
        units = {key: cs for key, cs in units.items() if len(cs) == members[key]}
        def extra(cs: list[Candidate]) -> float:
            return sum(c.extra_bits for c in cs)
        kl_gains = self._kl_gains(units) if self.reference is not None else None
        def gain(cs: list[Candidate]) -> float:
            if kl_gains is not None:
                return kl_gains[sensitivity_unit(cs[0].name, self.opts)] / max(extra(cs), 1.0)
            return sum(c.row.metrics["output_error"] - c.error for c in cs) / max(extra(cs), 1.0)
        before = self.average_bits() if self.opts.average_bits is not None else None
        if before is None:
            budget = q4_k_m_budget(self.opts, self.plans, self.model.config.n_layers)
        else:
            budget = (self.opts.average_bits - before) * self.weights
        spent, chosen, layers = 0.0, [], 0
        for key, cs in sorted(units.items(), key=lambda unit: gain(unit[1]), reverse=True):
            if spent + extra(cs) > budget or (kl_gains is not None and kl_gains[key] <= 0):
                continue
            spent += extra(cs)
            chosen.append(key)
            layers += len(cs)
            for c in cs:
                self._upgrade(c)
        self.wider = []
        measure = ("the model's KL from float it removes on the validation windows" if kl_gains is not None
                   else "measured error reduction")
        if before is None:
            return (f"q4_k_m: {layers} of the layers in the wider type, chosen by {measure} per bit "
                    f"within llama.cpp's Q4_K_M budget for this model ({spent / 8e6:.2f} of {budget / 8e6:.2f} MB extra)")
        return (f"average_bits {self.opts.average_bits}: {layers} of {len(self.plans)} layers in INT8 (W8A16), "
                f"chosen by {measure} per extra bit (q/k/v, gate/up and a layer's experts "
                f"together): {compact_names(chosen) or 'none'}; {self.average_bits():.3f} bits per weight over the "
                f"converted layers (all INT4: {before:.3f})")

    def _float_on_validation(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The validation windows and the float model's logits on them, once for both KL measurements."""
        if self.validation is None:
            windows = self.context.validation_windows(self.opts.validation_windows)
            self.validation = windows, teacher_logits(self.reference, windows)
        return self.validation

    @torch.no_grad()
    def _kl_gains(self, units: dict[str, list[Candidate]]) -> dict[str, float]:
        """``sensitivity = "kl"``: for each unit, the whole quantized model's mean per-token KL from the
        float model on the validation windows, less the same with that unit alone on its wider grid —
        the end-to-end gain, where a layer's own output error misses what follows it. One forward per unit."""
        windows, logits = self._float_on_validation()
        def kl() -> float:
            return compare_on_windows(self.reference, self.model, windows, reference=logits)["kl"]
        base, gains = kl(), {}
        for key, cs in track(list(units.items()), "awq: KL each unit's wider grid removes"):
            narrow = [self.model.get_submodule(c.name) for c in cs]
            for c in cs:
                self.model.set_submodule(c.name, c.module)
            try:
                gains[key] = base - kl()
            finally:
                for c, module in zip(cs, narrow):
                    self.model.set_submodule(c.name, module)
        return gains

    def _upgrade(self, c: Candidate) -> None:
        """Swap in ``c``'s wider module and say so in its row."""
        self.model.set_submodule(c.name, c.module)
        row = c.row
        if isinstance(c.module, GgufLinear):
            label, row.format = f"q4_k_m: {c.module.block_type}", f"gguf:{c.module.block_type}"
            row.metrics["clip_ratio"] = round(float(c.clip.mean()), 4)
        else:
            label, row.format = "average_bits: int8 W8A16", "int8"
            for key in ("group_size", "clip_ratio"):  # the INT4 layout's, not the layer's
                row.metrics.pop(key, None)
        row.reason = f"{row.reason}; {label}, measured sensitive (output error {row.metrics['output_error']:.4f} -> {c.error:.4f})"
        row.metrics["output_error"] = c.error

    @torch.no_grad()
    def measure_kl_alone(self) -> None:
        """``sensitivity = "kl"``: each converted layer's mean per-token KL from the float model (AWQ's
        scales folded in, which leaves it the same function) with that layer alone quantized, on the
        validation windows. One forward over them per layer."""
        windows, logits = self._float_on_validation()
        reference, self.reference = self.reference, None
        for row in track([r for r in self.report.layers if r.format != "float"], "awq: KL of each layer alone"):
            float_module = reference.get_submodule(row.module)
            reference.set_submodule(row.module, self.model.get_submodule(row.module))
            try:
                row.metrics["kl_alone"] = compare_on_windows(reference, reference, windows, reference=logits)["kl"]
            finally:
                reference.set_submodule(row.module, float_module)

    def finish(self) -> PassReport:
        opts, report = self.opts, self.report
        if HEAD_GROUP.linears[0] in self.plans:
            self.quantize_head()
        self.x = None  # the last block's outputs: nothing reads them
        if self.wider:
            report.notes.append(self.upgrade_sensitive())
        if self.reference is not None:
            self.measure_kl_alone()
            report.notes.append(f"kl_alone: each layer's KL from the float model with it alone quantized, on "
                                f"{opts.validation_windows} windows of the calibration corpus' validation region")
        report.metrics = _metrics(report.layers, self.windows, opts)
        if opts.average_bits is not None:
            report.metrics["bits_per_weight"] = round(self.average_bits(), 4)
        if self.model.config.spec.is_moe:
            report.metrics["experts_starved"] = self.starved
        scoring = (f"the best {opts.module_candidates} re-scored on self_attn / mlp outputs over {self.k} sequences"
                   if opts.module_candidates > 1 and self.k else "scored on the linears' own output error")
        report.notes.append(f"α grid of {opts.alpha_grid} (duo scaling {opts.duo_scaling}), "
                            f"{scoring}; clip search skips q_proj/k_proj (as llm-awq); "
                            f"{'GPTQ' if opts.weight_rounding == 'gptq' else 'round-to-nearest'} rounding")
        if unsmoothed := sorted({n for g in layer_groups(self.model.config, 0) if g.prev is None for n in g.linears}):
            report.notes.append(f"{', '.join(unsmoothed)}: clipped and quantized without smoothing "
                                "(no exact fold for its input; as llm-compressor)")
        return report


class BlockQuantizer:
    """Scale search, folding, clip search and quantization of one decoder block."""

    def __init__(self, model, prefix: str, plans: dict[str, LayerPlan], opts: AWQOptions, target: str | None,
                 groups: tuple[ScalingGroup, ...]):
        self.model, self.prefix, self.plans, self.opts, self.target = model, prefix, plans, opts, target
        self.groups = groups
        self.block = model.get_submodule(prefix.rstrip("."))
        self.config = model.config
        self.inspected: dict[str, tuple[tuple, torch.Tensor]] = {}  # set by run(); empty: Gram loss only
        self.routed: dict[str, int] = {}  # expert linear (relative name) -> calibration tokens routed to it
        self.starved: list[str] = []  # the converted expert linears below min_expert_tokens
        self.wider: dict[str, tuple] = {}  # (module, clip, error) on the wider grid, by linear (spends_bits)
        self.layer_tokens = 0
        self.on_folded = lambda: None  # called once the scales are folded, before any quantization

    def count_experts(self, stats: dict[str, InputStatistics], layer_tokens: int) -> None:
        """Record each expert linear's routed token count and which converted ones are starved."""
        names = [n for g in self.groups for n in g.linears]
        self.layer_tokens = layer_tokens
        self.routed = {n: stats[n].tokens for n in names if expert_of(n) is not None}
        converted = [n for n in names if self.prefix + n in self.plans]
        self.starved = starved_linears(stats, converted, self.opts.min_expert_tokens)

    def _rtn_only(self, name: str) -> bool:
        return name in self.starved and self.opts.starved_experts == "rtn"

    def run(self, stats: dict[str, InputStatistics], sample: tuple) -> list[LayerDecision]:
        """Search, fold and quantize; return one report row per converted linear. ``sample``:
        block inputs (x, cos, sin, positions) of a few calibration sequences for module scoring."""
        self.inspected = self._inspect_modules(sample)
        rows, hessians = self.search_and_fold(stats)
        self.on_folded()
        left = [n for n in self.plans if n.startswith(self.prefix) and n[len(self.prefix):] not in rows]
        if left:  # a planned linear no scaling group names would stay float against its plan
            raise RuntimeError(f"awq: no scaling group of {self.config.architecture} covers {', '.join(left)}")
        for name, row in rows.items():
            metrics, why = self._quantize(name, hessians[name])
            row.metrics.update(metrics)
            if why:
                row.reason = f"{row.reason}; {why}"
        return list(rows.values())

    def search_and_fold(self, stats: dict[str, InputStatistics]) -> tuple[dict[str, LayerDecision], dict[str, torch.Tensor]]:
        """Steps 2-3: the block's float function is unchanged; returns report rows and the
        Gram matrices of each linear's (now scaled) input."""
        rows: dict[str, LayerDecision] = {}
        hessians: dict[str, torch.Tensor] = {}
        searched = []
        # Search every group on the original block first (as llm-awq does), then fold all scales.
        for group in self.groups:
            for name in group.linears:
                h = hessians[name] = stats[name].hessian
                if (plan := self.plans.get(self.prefix + name)) is not None:
                    rows[name] = LayerDecision(plan.name, _format_label(plan), plan.reason, {
                        "group_size": plan.group_size, "scale_group": _group_label(group),
                        "rel_error_rtn": self._rtn_error(name, plan, h, stats[name].tokens)})
                    self._note_expert(name, rows[name], stats[name].tokens)
            searched.append((group, self._search(group, stats)))
        for group, found in searched:
            if found is None:
                continue
            s, s_cols, alpha = found
            fold_scales(self.block, group, s, s_cols)
            for name in group.linears:
                hessians[name] = hessians[name] / torch.outer(s_cols, s_cols)
                if name in rows:
                    rows[name].metrics["alpha"] = alpha
        return rows, hessians

    def _rtn_error(self, name: str, plan: LayerPlan, h: torch.Tensor, tokens: int) -> float | None:
        if tokens == 0:
            return None  # no calibration token: no output error to measure
        w = self.block.get_submodule(name).weight.float()
        return relative_error(w, quant_error(w, self._grid(plan)), h)

    def _note_expert(self, name: str, row: LayerDecision, calibrated_on: int) -> None:
        """An expert's row: its routed token count, and the starved-expert policy if it applied
        (with the tokens its statistics then hold)."""
        if name not in self.routed:
            return
        row.metrics["expert_tokens"] = self.routed[name]
        if name in self.starved:
            row.metrics["calibration_tokens"] = calibrated_on
            row.reason = starved_reason(self.routed[name], self.layer_tokens, self.opts.min_expert_tokens,
                                        self.opts.starved_experts)

    def _inspect_modules(self, sample: tuple) -> dict[str, tuple[tuple, torch.Tensor]]:
        """Float (args, output) of each group's ``inspect`` module on the sample sequences (None: no sample)."""
        names = {g.inspect for g in self.groups if g.inspect}
        if not names or self.opts.module_candidates < 2 or sample[0].shape[0] == 0:
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
                grid = self._grid(self.plans[self.prefix + name])
                lin.weight.data = ((scaled + quant_error(scaled, grid)) / s_cols).to(lin.weight.dtype)
            return float((module(*args).float() - reference.float()).pow(2).mean())
        finally:
            for name, w in saved.items():
                self.block.get_submodule(name).weight.data = w

    def _search(self, group: ScalingGroup, stats: dict[str, InputStatistics]):
        converted = [n for n in group.linears if self.prefix + n in self.plans]
        searched = [n for n in converted if not self._rtn_only(n)]
        if not searched or group.prev is None:
            return None  # nothing quantized here (or only round-to-nearest), or nothing to fold into
        expand = expand_columns(self.block, group, self.config)
        c = self.block.get_submodule(group.prev).weight.shape[0]
        to_channels = (lambda v: v) if expand is None else (lambda v: _average_by(v, expand, c))  # columns -> prev's channels
        to_columns = (lambda s: s) if expand is None else (lambda s: s[expand])  # and back
        mean = to_channels(stats[group.linears[0]].mean_abs)
        parts = self._loss_parts(searched, stats)
        grid = self._grid(self.plans[self.prefix + searched[0]])
        duo = self.opts.duo_scaling == "all" or self.opts.duo_scaling == "auto" and group.duo
        w_mean = to_channels(_weight_mean(parts, grid.block)) if duo else None
        ranked = rank_scales(parts, mean, grid, self.opts.alpha_grid, expand, w_mean)
        if group.inspect in self.inspected:  # the Gram loss shortlists, the module's output decides
            shortlist = ranked[: self.opts.module_candidates]
            ranked = sorted(((self._module_error(group, converted, to_columns(s)), a, s) for _, a, s in shortlist),
                            key=lambda r: r[0])
        _, alpha, s = ranked[0]
        return s, to_columns(s), alpha

    def _loss_parts(self, names: list[str], stats: dict[str, InputStatistics]) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        """(stacked weights, Gram matrix, weight) per distinct input among ``names``' linears: one
        part where they read one tensor (q/k/v, gate/up); in an MoE norm's group one per expert,
        weighted by its share of the routed tokens, so that each expert's error counts on its tokens."""
        by_input: dict[int, list[str]] = {}
        for n in names:
            by_input.setdefault(id(stats[n]), []).append(n)
        if len(by_input) == 1:
            shares = [1.0]
        else:
            counts = [self.routed.get(ns[0], stats[ns[0]].tokens) for ns in by_input.values()]
            shares = [c / max(sum(counts), 1) for c in counts]
        return [(torch.cat([self.block.get_submodule(n).weight.float() for n in ns]), stats[ns[0]].hessian, share)
                for ns, share in zip(by_input.values(), shares)]

    def _grid(self, plan: LayerPlan, block_type: str | None = None):
        return grid_of(block_type or plan.block_type, plan.group_size, self.opts.zero_point)

    def _quantize(self, name: str, h: torch.Tensor) -> tuple[dict, str | None]:
        """Clip-search and quantize one (already scaled) linear; retry smaller groups if too lossy.
        Returns the row's metrics and what ``max_layer_error`` made of it (None: nothing)."""
        plan, opts = self.plans[self.prefix + name], self.opts
        linear = self.block.get_submodule(name)
        w = linear.weight.float()
        g, why = plan.group_size, None
        if self._rtn_only(name):  # a starved expert under starved_experts = "rtn"
            q = self._grid(plan).module(linear, 1.0, None, opts.gptq_damp)
            err = relative_error(w, q.dequantized_weight().float() - w, h) if self.routed[name] else None
            self.block.set_submodule(name, q)
            return {"group_size": g, "output_error": err}, None
        if (wide := self._wider_grid(plan)) is not None:
            self.wider[name] = self._search_and_round(linear, name, h, wide)
        while True:
            q, clip, err = self._search_and_round(linear, name, h, grid_of(plan.block_type, g, opts.zero_point))
            if opts.max_layer_error is None or err <= opts.max_layer_error:
                break
            retry = [] if plan.block_type else [
                g2 for g2 in smaller_groups(plan.in_features, g, opts.group_size_policy) if self._target_accepts(plan, g2)]
            if not retry:
                why = f"relative error {err:.4f} > max_layer_error {opts.max_layer_error} at g{g}; no smaller group size left"
                break
            why = f"max_layer_error: relative error {err:.4f} > {opts.max_layer_error} at g{g}, retried with g{retry[0]}"
            g = retry[0]
        self.block.set_submodule(name, q)
        return {"group_size": g, "clip_ratio": round(float(clip.mean()), 4), "output_error": err}, why

    def _wider_grid(self, plan: LayerPlan) -> GgufGrid | Int8Grid | None:
        """The layer's candidate grid when bits are spent by sensitivity: q4_k_m's Q6_K (or Q8_0), average_bits' INT8."""
        if self.opts.average_bits is not None:
            return Int8Grid()
        wide = wider_type(self.opts, plan)
        return None if wide is None else self._grid(plan, wide)

    def _search_and_round(self, linear, name: str, h: torch.Tensor, grid):
        """(module, clip ratios, relative output error) of ``linear`` on ``grid``: clip search, then GPTQ or
        RTN, then the scales re-fit to the codes (``scale_refit``)."""
        opts = self.opts
        w = linear.weight.float()
        clip = (search_clip(w, h, grid, opts.clip_grid, opts.max_shrink)
                if opts.clip_search and name not in NO_CLIP and not isinstance(grid, Int8Grid) else torch.ones(1))
        q = grid.module(linear, clip, h if opts.weight_rounding == "gptq" else None, opts.gptq_damp)
        if opts.scale_refit:
            grid.refit(q, w, h)
        return q, clip, relative_error(w, q.dequantized_weight().float() - w, h)

    def _target_accepts(self, plan: LayerPlan, g: int) -> bool:
        if self.target is None:
            return True
        return get_target(self.target).check(plan.name, replace(plan, group_size=g).format(self.opts.zero_point)) is None


def _average_by(values: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Mean of ``values`` [K] over the columns ``index`` [K] maps to each of n channels."""
    return torch.zeros(n).index_add_(0, index, values) / torch.bincount(index, minlength=n)


def _weight_mean(parts: list[tuple[torch.Tensor, torch.Tensor, float]], group_size: int) -> torch.Tensor:
    """``weight_mean`` over the rows of every part's weights (duo scaling's weight term)."""
    if len(parts) == 1:
        return weight_mean(parts[0][0], group_size)
    rows = sum(w.shape[0] for w, _, _ in parts)
    return sum(weight_mean(w, group_size) * (w.shape[0] / rows) for w, _, _ in parts)


def _format_label(plan: LayerPlan) -> str:
    return f"gguf:{plan.block_type}" if plan.block_type else "int4"


def _group_label(group: ScalingGroup) -> str:
    """'input_layernorm → q_proj, k_proj, v_proj'; 'post_attention_layernorm → gate, experts.*.gate_proj, …'."""
    short = [re.sub(r".*\.(experts)\.\d+\.", r"\1.*.", n) if ".experts." in n else n.rpartition(".")[2]
             for n in group.linears]
    return f"{group.prev or '(no smoothing)'} → {', '.join(dict.fromkeys(short))}"


def _metrics(layers: list[LayerDecision], windows: torch.Tensor, opts: AWQOptions) -> dict:
    quantized = [r.metrics for r in layers if r.format != "float"]
    def mean(key: str) -> float:  # over the layers that have the figure (a starved expert may have none)
        values = [r[key] for r in quantized if r.get(key) is not None]
        return sum(values) / max(len(values), 1)

    sizes: dict[str, int] = {}  # INT4's group sizes (INT8 layers apart), or the GGUF block types
    for r in layers:
        if r.format not in ("float", "int8"):
            key = r.format.removeprefix("gguf:") if r.format.startswith("gguf:") else f"g{r.metrics['group_size']}"
            sizes[key] = sizes.get(key, 0) + 1
    grid = "block_types" if any(r.format.startswith("gguf:") for r in layers) else "group_sizes"
    metrics = {"layers_quantized": len(quantized), "layers_float": len(layers) - len(quantized),
               grid: ", ".join(f"{k}: {v}" for k, v in sorted(sizes.items())), "mean_rel_error_rtn": mean("rel_error_rtn"),
               "calibration_tokens": windows.numel(), "search_tokens_per_block": min(opts.search_tokens, windows.numel())}
    if opts.average_bits is not None:
        metrics["layers_int8"] = sum(r.format == "int8" for r in layers)
    return metrics
