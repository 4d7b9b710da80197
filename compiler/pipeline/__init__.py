"""Passes and the pipeline that runs them.

A ``Pass`` declares its name, a typed options dataclass, the properties it requires and
provides, and the storage format it plans for each module it converts. A ``Pipeline`` is built
from a TOML file and validated as a whole (unknown pass, bad option, impossible order, two
passes claiming one layer, formats the target cannot run) before any pass runs. Validating
makes the ``CompilePlan``: the model on the meta device and what each pass will do, made once
per compile and handed to everything after it (the memory plan, the passes through
``PassContext.plan``, the streamed compile) instead of being worked out again by each.

    [model]
    dtype = "float32"
    [calibration]
    corpus = "pydoc"
    samples = 128
    seq_len = 512
    seed = 0
    [[passes]]
    name = "awq"
    group_size = 128

Passes live in ``passes/`` and register themselves by name with ``@register_pass``. What every
pass shares: ``modules_to_not_convert`` means one thing (``selection.py``, checked here against
the model before any pass runs), each report row is a ``LayerDecision``, and activation
statistics come from one collector (``calibration.py``) through ``PassContext.input_statistics``.
"""
from __future__ import annotations

import time
import tomllib
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from calib import (
    CalibrationConfig,
    calibration_windows,
    corpus_parts,
    evaluation_windows,
    load_corpus_text,
    split_tokens,
)
from calib.protocol import TokenSplit
from compiler.errors import (
    ConfigError,
    PassError,
    PipelineValidationError,
    QCompileError,
)
from compiler.model.config import ModelConfig
from compiler.model.transformer import Transformer
from compiler.options import parse_options, suggest
from compiler.pipeline.calibration import (
    CalibrationStatistics,
    InputRequest,
    StatisticsCache,
    collect_model,
)
from compiler.pipeline.selection import check_patterns, meta_model
from compiler.progress import track

# Holds until a pass converts a layer (plans a storage format for it): what a pass rewriting every
# weight needs (``rotate``).
UNCONVERTED = "no_converted_layers"
# Properties that hold for a freshly loaded checkpoint.
INITIAL_PROPERTIES = frozenset({"float_weights", UNCONVERTED})


@dataclass
class LayerDecision:
    """One row of a pass report: what the pass did with one module, and why.

    In the manifest: ``{"module": "layers.0.mlp.down_proj", "format": "int4", "reason": "requested",
    "metrics": {"group_size": 128, "output_error": 0.031, ...}}``. Every quantizing pass gives a
    converted layer ``output_error``: the relative output error it adds on calibration inputs,
    ||X (W_q - W)ᵀ|| / ||X Wᵀ|| (``qcompile inspect``'s most sensitive layers are ranked by it).
    """

    module: str  # the full module name
    format: str  # what it is stored as now: a weight format ("int4", "fp8") or "float" (left as it was)
    reason: str  # why: the plan, the modules_to_not_convert pattern, the error bound it failed
    metrics: dict[str, Any] = field(default_factory=dict)  # the pass's per-layer figures


@dataclass
class PassReport:
    """What a pass did: metrics, one ``LayerDecision`` per layer it decided on, notes; stored in the manifest."""

    name: str
    options: dict = field(default_factory=dict)
    wall_time_s: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    layers: list[LayerDecision] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PassPlan:
    """What ``Pass.plan`` found a pass will do to a model, before any work. A pass that needs more
    of its plan when it runs (AWQ: each layer's group size and why) returns a subclass."""

    formats: dict[str, dict] = field(default_factory=dict)  # module -> the storage format it will get (its claims)
    # module -> the other format the pass may give it instead once it has measured the layer (AWQ's average_bits:
    # INT8 W8A16; gguf:q4_k_m: Q6_K; int8's dynamic_fallback: dynamic activations), so that the target is checked
    # for it before any work
    alternatives: dict[str, dict] = field(default_factory=dict)


@dataclass(frozen=True)
class CompilePlan:
    """What ``Pipeline.validate`` found, once per compile, for everything after it."""

    meta: Transformer  # the model on the meta device: every module's name and shape, no weights
    passes: dict["Pass", PassPlan]  # each pass of the pipeline, in order -> its plan
    formats: dict[str, dict]  # every planned module's storage format, over all the passes
    alternatives: dict[str, dict] = field(default_factory=dict)  # the other formats passes may give instead


@dataclass
class PassContext:
    """What a running pass may use besides the model: tokenizer, calibration data, shared state."""

    tokenizer: Any
    calibration: CalibrationConfig
    target: str | None = None
    plan: CompilePlan | None = None  # what validate planned; None for passes run outside a compile
    manifest_extras: dict[str, Any] = field(default_factory=dict)  # e.g. the serving plan
    history: list[str] = field(default_factory=list)  # names of passes already run
    statistics: StatisticsCache = field(default_factory=StatisticsCache)
    _splits: list[TokenSplit] | None = None

    def plan_of(self, p: "Pass") -> PassPlan | None:
        """What validate planned for pass ``p`` (None outside a compile: the pass then plans for itself)."""
        return self.plan.passes.get(p) if self.plan else None

    def token_splits(self) -> list[TokenSplit]:
        """Each corpus of the calibration spec (``a+b`` mixes them) tokenized once and split by the protocol."""
        if self._splits is None:
            if self.tokenizer is None:
                raise ConfigError("calibration needs a tokenizer, and this checkpoint ships none")
            texts = [load_corpus_text(part) for part in corpus_parts(self.calibration.corpus)]
            self._splits = [split_tokens(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        return self._splits

    def calibration_windows(self, samples: int | None = None, seq_len: int | None = None) -> torch.Tensor:
        c = self.calibration
        pools = [split.pool for split in self.token_splits()]
        return calibration_windows(pools, samples or c.samples, seq_len or c.seq_len, c.seed)

    def validation_windows(self, count: int) -> torch.Tensor:
        """About ``count`` windows of ``seq_len`` tokens from the validation region of each corpus
        (an equal share, one at least): where a pass scores its choices, never the evaluation region."""
        splits = self.token_splits()
        share = max(1, count // len(splits))
        return torch.cat([evaluation_windows(s.validation, share, self.calibration.seq_len) for s in splits])

    def input_statistics(self, model: torch.nn.Module, windows: torch.Tensor, requests: dict[str, InputRequest],
                         kv_heads: bool = False, label: str = "calibrating", batch_size: int = 4) -> CalibrationStatistics:
        """``calibration.collect_model`` over ``windows``, shared with any pass that asks the same
        of the model in the same state (one forward, not one per pass)."""
        return collect_model(model, windows, requests, kv_heads, batch_size, label=label, cache=self.statistics)


@dataclass
class NoOptions:
    pass


class BlockStream:
    """A pass working one decoder block at a time (``Pass.scope`` "block"). The same calls serve
    a model in memory (``Pass.run``) and a streamed compile (``compiler/pipeline/streaming.py``),
    whose model holds its embeddings, final norm and lm_head but only the block being worked on:

    ``Pass.stream(model, context)``  the embeddings are there: draw the calibration inputs
    ``block(index)``                  ``model.layers[index]`` is there: calibrate and convert it
                                      in place; its outputs become the next block's inputs
    ``finish()``                      every block is done (and, streamed, written and gone): the report
    """

    def block(self, index: int) -> None:
        raise NotImplementedError

    def finish(self) -> PassReport:
        raise NotImplementedError


class Pass:
    """Base of every pass. Subclasses set the class attributes and implement ``run``, or, for a
    pass that works block by block, ``scope`` and ``stream`` (``run`` then drives the stream).

    An option named ``modules_to_not_convert`` (a list of patterns) means what
    ``compiler.pipeline.selection`` says; ``Pipeline.validate`` rejects a pattern naming no module.

    ``check``, ``plan``, ``scope`` and ``working_memory`` get the model on the meta device (its
    ``config``, module names and shapes; no weights), built once per compile.
    """

    name: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    requires: ClassVar[frozenset[str]] = frozenset()
    provides: ClassVar[frozenset[str]] = frozenset()
    invalidates: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, options):
        self.options = options

    def check(self, model: Transformer) -> None:
        """Static checks against the model; raise ``ConfigError`` with a fix hint."""

    def plan(self, model: Transformer) -> PassPlan:
        """What this pass will do to ``model``: the storage format of each module it converts (claims
        those modules); may raise ``ConfigError``. Made once, by validate; ``PassContext.plan_of`` hands it back."""
        return PassPlan()

    def scope(self, model: Transformer) -> Literal["model", "block", "config"]:
        """What the pass needs of the model at once, for a streamed compile: "model", the whole
        model in memory (the default; e.g. distillation's end-to-end training); "block", one
        decoder block at a time through ``stream``; "config", no weights (the config and dtype)."""
        return "model"

    def working_memory(self, model: Transformer, calibration: CalibrationConfig, dtype_bytes: int,
                       streamed: bool) -> dict[str, int]:
        """Bytes the pass needs beyond the model's weights, by what they hold (``memory.py`` adds
        them up before any work); ``streamed``: a block at a time."""
        return {}

    def stream(self, model: torch.nn.Module, context: PassContext) -> BlockStream:
        raise NotImplementedError(f"pass {self.name} does not work block by block")

    def run(self, model: torch.nn.Module, context: PassContext) -> PassReport:
        if type(self).stream is Pass.stream:  # a pass that works block by block drives its stream here
            raise NotImplementedError
        stream = self.stream(model, context)
        for i in track(range(len(model.layers)), f"{self.name}: blocks", total=len(model.layers)):
            stream.block(i)
        return stream.finish()


def output_error_summary(layers: list[LayerDecision]) -> dict[str, float]:
    """Mean and max ``output_error`` over the converted layers that measured one (none: {})."""
    errors = [r.metrics["output_error"] for r in layers if r.format != "float" and r.metrics.get("output_error") is not None]
    if not errors:
        return {}
    return {"mean_output_error": sum(errors) / len(errors), "max_output_error": max(errors)}


PASSES: dict[str, type[Pass]] = {}


def register_pass(cls: type[Pass]) -> type[Pass]:
    if cls.name in PASSES:
        raise ValueError(f"pass {cls.name!r} registered twice")
    PASSES[cls.name] = cls
    return cls


@dataclass(frozen=True)
class ModelSection:
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


@dataclass(frozen=True)
class TargetSection:
    name: str | None = None


_SECTIONS = {"model": ModelSection, "calibration": CalibrationConfig, "target": TargetSection}


@dataclass
class PipelineConfig:
    model: ModelSection = field(default_factory=ModelSection)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    target: TargetSection = field(default_factory=TargetSection)
    passes: list[dict] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> "PipelineConfig":
        known = set(_SECTIONS) | {"passes"}
        for key in d:
            if key not in known:
                raise ConfigError(f"pipeline: unknown section [{key}]{suggest(key, known)}")
        sections = {k: parse_options(c, d.get(k), f"[{k}]") for k, c in _SECTIONS.items()}
        passes = d.get("passes", [])
        if not isinstance(passes, list) or not all(isinstance(p, dict) for p in passes):
            raise ConfigError("pipeline: 'passes' must be an array of tables ([[passes]])")
        return cls(passes=[dict(p) for p in passes], **sections)

    @classmethod
    def from_toml(cls, path: str | Path) -> "PipelineConfig":
        path = Path(path)
        try:
            return cls.from_dict(tomllib.loads(path.read_text()))
        except FileNotFoundError:
            raise ConfigError(f"pipeline file {path} not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None

    def to_dict(self) -> dict:
        d = {"model": asdict(self.model), "calibration": asdict(self.calibration), "passes": self.passes}
        if self.target.name:
            d["target"] = asdict(self.target)
        return d


class Pipeline:
    """The passes of a ``PipelineConfig``, instantiated with parsed options."""

    def __init__(self, config: PipelineConfig):
        self.config = config
        self.passes: list[Pass] = []
        for i, entry in enumerate(config.passes):
            where = f"passes[{i}]"
            name = entry.get("name")
            if not isinstance(name, str):
                raise PipelineValidationError(f"{where}: every [[passes]] entry needs a name = \"...\"")
            if name not in PASSES:
                raise PipelineValidationError(f"{where}: unknown pass {name!r}{suggest(name, PASSES)}")
            cls = PASSES[name]
            options = {k: v for k, v in entry.items() if k != "name"}
            self.passes.append(cls(parse_options(cls.Options, options, f"{where} ({name})")))

    def validate(self, model_config: ModelConfig) -> CompilePlan:
        """Check order, claims, per-pass constraints and the target against a model of ``model_config``;
        return the compile's plan (a compile validates once and hands the plan down)."""
        if self.config.model.dtype == "float16" and (why := model_config.spec.float16_unsafe):
            raise PipelineValidationError(f"model.dtype float16: {model_config.architecture} cannot run in float16, "
                                          f"{why}; set dtype = \"bfloat16\" or \"float32\"")
        meta = meta_model(model_config)
        properties = set(INITIAL_PROPERTIES)
        claimed: dict[str, str] = {}
        plans: dict[Pass, PassPlan] = {}
        formats: dict[str, dict] = {}
        alternatives: dict[str, dict] = {}
        kv_cache = None  # the pass that declares the manifest's one KV-cache entry
        for i, p in enumerate(self.passes):
            where = f"passes[{i}] ({p.name})"
            if getattr(p.options, "kv_cache_dtype", "none") != "none":
                if kv_cache:
                    raise PipelineValidationError(f"{where}: kv_cache_dtype: {kv_cache} already declares the KV "
                                                  "cache, and an artifact has one; set it in one pass")
                kv_cache = where
            missing = p.requires - properties
            if UNCONVERTED in missing:
                first = next(iter(claimed.values()))  # the first pass that claimed (converts) a layer
                raise PipelineValidationError(f"{where}: must run before any pass that converts layers "
                                              f"({first}); move it before that one")
            if missing:
                providers = sorted(n for n, c in PASSES.items() if c.provides & missing)
                hint = f"; run {' or '.join(providers)} before it" if providers else ""
                raise PipelineValidationError(f"{where}: requires {', '.join(sorted(missing))}, which no earlier pass provides{hint}")
            plans[p] = _checked_plan(p, meta, where)
            for module, fmt in plans[p].formats.items():
                if module in claimed:
                    raise PipelineValidationError(f"{where}: layer {module} is already claimed by {claimed[module]}; exclude it from one of them with modules_to_not_convert")
                claimed[module] = where
                formats[module] = fmt
            alternatives |= plans[p].alternatives
            properties = (properties - p.invalidates) | p.provides
            if claimed:
                properties.discard(UNCONVERTED)
        if self.config.target.name:
            self._check_target(formats, alternatives, model_config)
        return CompilePlan(meta, plans, formats, alternatives)

    def _check_target(self, formats: dict[str, dict], alternatives: dict[str, dict], model_config: ModelConfig) -> None:
        """Whether the target runs every planned format (and every other one a pass may choose instead) and the
        deployment as a whole."""
        from compiler.deploy.targets import DeploymentPlan, check_formats, check_plan

        plan = DeploymentPlan(self.config.model.dtype, formats, [(p.name, p.options) for p in self.passes],
                              config=model_config)
        try:
            check_formats(self.config.target.name, formats, "pipeline")
            check_formats(self.config.target.name, alternatives, "pipeline (the other format a pass may give a layer "
                          "it measures sensitive)")
            check_plan(self.config.target.name, plan, "pipeline")
        except ConfigError as e:
            raise PipelineValidationError(str(e)) from None

    def run(self, model: torch.nn.Module, context: PassContext) -> list[PassReport]:
        reports = []
        for i, p in enumerate(self.passes):
            start = time.perf_counter()
            with self.failures(i, context):
                report = p.run(model, context)
            reports.append(self.record(i, report, time.perf_counter() - start, context))
            context.statistics.prune(model)  # statistics of a model this pass changed are stale
        return reports

    @contextmanager
    def failures(self, i: int, context: PassContext):
        """Turn an unexpected exception inside pass ``i`` into a ``PassError`` naming it and what ran before it."""
        try:
            yield
        except QCompileError:
            raise
        except Exception as e:
            before = ", ".join(context.history) or "nothing"
            raise PassError(f"pass {self.passes[i].name} (passes[{i}], after {before}) failed: {type(e).__name__}: {e}") from e

    def record(self, i: int, report: PassReport, seconds: float, context: PassContext) -> PassReport:
        """Complete pass ``i``'s report (its options, wall time) and count the pass as run."""
        report.options = asdict(self.passes[i].options)
        report.wall_time_s = round(seconds, 3)
        report.metrics |= output_error_summary(report.layers)
        context.history.append(self.passes[i].name)
        return report


def _checked_plan(p: Pass, meta: Transformer, where: str) -> PassPlan:
    """Pass ``p``'s checks against the model and its plan; a ``ConfigError`` comes back naming the pass."""
    try:
        if patterns := getattr(p.options, "modules_to_not_convert", None):
            check_patterns(patterns, meta)
        p.check(meta)
        return p.plan(meta)
    except ConfigError as e:
        raise PipelineValidationError(f"{where}: {e}") from None
