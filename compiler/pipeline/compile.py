"""``compile``: load a checkpoint, validate the pipeline, plan its memory, run its passes, write the artifact.

Two ways through, with the same result: in memory (load the model, run the passes on it, save
it), or streamed, one decoder block at a time (``streaming.py``), for a model bigger than the
memory the compile may use. ``streaming``: "auto" (the default) streams when the in-memory plan
does not fit the limit and the compile can stream; "on" streams or says why it cannot; "off"
never streams. The memory plan (``memory.py``) is checked before any work.

Either way the pipeline is built and validated once; validating makes the ``CompilePlan`` (the
meta model, each pass's plan), which the memory plan, the passes and the streamed compile read.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from compiler.deploy.targets import check_formats
from compiler.errors import ConfigError
from compiler.formats.qlinear import quantized_modules
from compiler.io.artifact import save_artifact
from compiler.io.load import Checkpoint, load_checkpoint, loaded_dtype, locate_checkpoint, peek_config
from compiler.io.types import LoadedModel, parse_dtype
from compiler.pipeline import CompilePlan, PassContext, PassReport, Pipeline, PipelineConfig
from compiler.pipeline.memory import MemoryPlan, check_fits, format_size, machine_limit, plan_memory
from compiler.pipeline.streaming import compile_streamed, streaming_blocker

Streaming = Literal["auto", "on", "off"]


@dataclass
class CompileResult:
    path: Path
    loaded: LoadedModel | None  # the compiled model in memory; None when streamed (load the artifact)
    reports: list[PassReport]  # this compile's passes (the manifest also holds an input artifact's)
    memory: MemoryPlan | None = None  # the estimated peak the compile was planned with
    limit_bytes: int = 0  # the memory limit it was planned against

    @property
    def streamed(self) -> bool:
        return self.loaded is None


def compile_loaded(loaded: LoadedModel, config: PipelineConfig | Pipeline, out: str | Path, force: bool = False,
                   memory_limit: int | None = None) -> CompileResult:
    """Run ``config``'s passes on an already loaded model (modified in place) and write the artifact.

    ``config`` may be the ``Pipeline`` already built from it (by a caller that parses the options
    before a slow load). When ``loaded`` is an artifact, its passes stay in the new manifest: its
    ``[[passes]]`` entries come before this pipeline's, its pass reports before this compile's,
    and with a ``[target]`` the formats it already holds are checked as well as the planned ones.
    Under ``torchrun`` (a distributed pass) every rank runs the passes and rank 0 alone writes the
    artifact. ``memory_limit`` (bytes; default what the machine allows) bounds the planned peak.
    """
    pipeline = config if isinstance(config, Pipeline) else Pipeline(config)
    plan = pipeline.validate(loaded.model.config)
    limit = memory_limit or machine_limit()
    dtype = loaded.model.embed_tokens.weight.dtype
    memory = plan_memory(pipeline.passes, plan.meta, pipeline.config.calibration, dtype, streamed=False)
    check_fits(memory, limit, pipeline.config.calibration, "the model is already loaded")
    reports = _run_in_memory(loaded, pipeline, plan, Path(out), force)
    return CompileResult(Path(out), loaded, reports, memory, limit)


def compile_model(model: str | Path, config: PipelineConfig, out: str | Path, allow_pickle: bool = False,
                  force: bool = False, streaming: Streaming = "auto", memory_limit: int | None = None) -> CompileResult:
    """Compile checkpoint ``model`` with ``config`` into the artifact directory ``out``, in memory or
    streamed (see the module docstring); the pipeline and its memory plan are checked before the load."""
    if streaming not in ("auto", "on", "off"):
        raise ConfigError(f"streaming must be auto, on or off, got {streaming!r}")
    pipeline = Pipeline(config)  # parse every pass's options before the (slow) load
    checkpoint = locate_checkpoint(model)
    plan = pipeline.validate(peek_config(checkpoint))
    limit = memory_limit or machine_limit()
    dtype = loaded_dtype(checkpoint, parse_dtype(config.model.dtype))
    memory = choose_memory_plan(pipeline, plan, checkpoint, dtype, streaming, limit)
    if memory.streamed:
        reports = compile_streamed(checkpoint, pipeline, plan, Path(out), force)
        return CompileResult(Path(out), None, reports, memory, limit)
    loaded = load_checkpoint(checkpoint, config.model.dtype, allow_pickle)
    reports = _run_in_memory(loaded, pipeline, plan, Path(out), force)
    return CompileResult(Path(out), loaded, reports, memory, limit)


def choose_memory_plan(pipeline: Pipeline, plan: CompilePlan, checkpoint: Checkpoint, dtype: torch.dtype,
                       streaming: Streaming, limit: int) -> MemoryPlan:
    """The memory plan of the way this compile will run (streamed or not); raises if it will not fit.
    "auto" plans a streamed compile only when the in-memory plan does not fit."""
    calibration = pipeline.config.calibration
    blocker = streaming_blocker(pipeline, plan, checkpoint)
    if streaming == "on" and blocker:
        raise ConfigError(f"--streaming on: this compile cannot stream: {blocker}; use --streaming auto or off")
    memory = plan_memory(pipeline.passes, plan.meta, calibration, dtype, streamed=streaming == "on")
    if streaming == "auto" and memory.total > limit and blocker is None:
        memory = plan_memory(pipeline.passes, plan.meta, calibration, dtype, streamed=True)
    check_fits(memory, limit, calibration, blocker)
    return memory


def _run_in_memory(loaded: LoadedModel, pipeline: Pipeline, plan: CompilePlan, out: Path,
                   force: bool) -> list[PassReport]:
    """Run the validated pipeline on the loaded model and write the artifact (see ``compile_loaded``)."""
    config = pipeline.config
    if config.target.name:
        held = {name: m.format_meta() for name, m in quantized_modules(loaded.model).items() if name not in plan.formats}
        check_formats(config.target.name, held, str(loaded.source.path))
    context = PassContext(tokenizer=loaded.tokenizer, calibration=config.calibration, target=config.target.name,
                          plan=plan)
    reports = pipeline.run(loaded.model, context)
    earlier = loaded.manifest  # an input artifact's record (None for a checkpoint)
    recipe = {**config.to_dict(), "passes": [*(earlier.pipeline.get("passes", []) if earlier else []), *config.passes]}
    history = [*(earlier.reports if earlier else []), *(r.to_dict() for r in reports)]
    if _writes_artifact():
        save_artifact(out, loaded.model, loaded.tokenizer, loaded.source, recipe, history, context.manifest_extras, force)
    return reports


def describe_plan(result: CompileResult) -> str:
    """One line for the command line: how the compile ran and its planned peak."""
    how = "streamed block by block" if result.streamed else "in memory"
    peak = format_size(result.memory.total) if result.memory else "?"
    return f"compiled {how}; planned peak {peak} of a {format_size(result.limit_bytes)} limit"


def _writes_artifact() -> bool:
    """Rank 0 of a ``torch.distributed`` job, or a single process: the writers of the artifact."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
