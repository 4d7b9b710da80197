"""``compile``: load a checkpoint, validate the pipeline, plan its memory, run its passes, write the artifact.

Two ways through, with the same result: in memory (load the model, run the passes on it, save
it), or streamed, one decoder block at a time (``streaming.py``), for a model bigger than the
memory the compile may use. ``streaming``: "auto" (the default) streams when the in-memory plan
does not fit the limit and the compile can stream; "on" streams or says why it cannot; "off"
never streams. The memory plan (``memory.py``) is checked before any work.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from compiler.deploy.targets import check_formats
from compiler.errors import ConfigError
from compiler.formats.qlinear import quantized_modules
from compiler.io.artifact import save_artifact
from compiler.io.checkpoint import resolve_model_path
from compiler.io.load import load_checkpoint, peek_config
from compiler.io.types import LoadedModel, parse_dtype
from compiler.model.config import ModelConfig
from compiler.pipeline import PassContext, PassReport, Pipeline, PipelineConfig
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


def compile_loaded(loaded: LoadedModel, config: PipelineConfig, out: str | Path, force: bool = False,
                   memory_limit: int | None = None) -> CompileResult:
    """Run ``config``'s passes on an already loaded model (modified in place) and write the artifact.

    When ``loaded`` is an artifact, its passes stay in the new manifest: its ``[[passes]]`` entries
    come before this pipeline's, its pass reports before this compile's, and with a ``[target]``
    the formats it already holds are checked as well as the planned ones. Under ``torchrun`` (a
    distributed pass) every rank runs the passes and rank 0 alone writes the artifact.
    ``memory_limit`` (bytes; default what the machine allows) bounds the planned peak.
    """
    pipeline = Pipeline(config)
    planned = pipeline.validate(loaded.model.config)
    limit = memory_limit or machine_limit()
    plan = plan_memory(pipeline.passes, loaded.model.config, config.calibration, loaded.model.embed_tokens.weight.dtype,
                       streamed=False)
    check_fits(plan, limit, config.calibration, "the model is already loaded")
    if config.target.name:
        held = {name: m.format_meta() for name, m in quantized_modules(loaded.model).items() if name not in planned}
        check_formats(config.target.name, held, str(loaded.source.path))
    context = PassContext(tokenizer=loaded.tokenizer, calibration=config.calibration, target=config.target.name)
    reports = pipeline.run(loaded.model, context)
    earlier = loaded.manifest or {}
    recipe = {**config.to_dict(), "passes": [*earlier.get("pipeline", {}).get("passes", []), *config.passes]}
    history = [*earlier.get("passes", []), *(r.to_dict() for r in reports)]
    path = Path(out)
    if _writes_artifact():
        save_artifact(path, loaded.model, loaded.tokenizer, loaded.source, recipe, history, context.manifest_extras, force)
    return CompileResult(path, loaded, reports, plan, limit)


def compile_model(model: str | Path, config: PipelineConfig, out: str | Path, allow_pickle: bool = False,
                  force: bool = False, streaming: Streaming = "auto", memory_limit: int | None = None) -> CompileResult:
    """Compile checkpoint ``model`` with ``config`` into the artifact directory ``out``, in memory or
    streamed (see the module docstring); the pipeline and its memory plan are checked before the load."""
    if streaming not in ("auto", "on", "off"):
        raise ConfigError(f"streaming must be auto, on or off, got {streaming!r}")
    pipeline = Pipeline(config)  # parse every pass's options before the (slow) load
    path = resolve_model_path(model)
    model_config = peek_config(path)
    pipeline.validate(model_config)
    limit = memory_limit or machine_limit()
    plan = choose_plan(pipeline, model_config, config, path, streaming, limit)
    if plan.streamed:
        reports = compile_streamed(path, config, pipeline, Path(out), force)
        return CompileResult(Path(out), None, reports, plan, limit)
    loaded = load_checkpoint(model, config.model.dtype, allow_pickle)
    return compile_loaded(loaded, config, out, force, limit)


def choose_plan(pipeline: Pipeline, model_config: ModelConfig, config: PipelineConfig, path: Path,
                streaming: Streaming, limit: int) -> MemoryPlan:
    """The memory plan of the way this compile will run (streamed or not); raises if it will not fit."""
    dtype = parse_dtype(config.model.dtype)
    blocker = streaming_blocker(pipeline, model_config, path)
    if streaming == "on" and blocker:
        raise ConfigError(f"--streaming on: this compile cannot stream: {blocker}; use --streaming auto or off")
    in_memory = plan_memory(pipeline.passes, model_config, config.calibration, dtype, streamed=False)
    streamed = None if blocker else plan_memory(pipeline.passes, model_config, config.calibration, dtype, streamed=True)
    use_streamed = streaming == "on" or (streaming == "auto" and streamed is not None and in_memory.total > limit)
    plan = streamed if use_streamed else in_memory
    check_fits(plan, limit, config.calibration, blocker)
    return plan


def describe_plan(result: CompileResult) -> str:
    """One line for the command line: how the compile ran and its planned peak."""
    how = "streamed block by block" if result.streamed else "in memory"
    peak = format_size(result.memory.total) if result.memory else "?"
    return f"compiled {how}; planned peak {peak} of a {format_size(result.limit_bytes)} limit"


def _writes_artifact() -> bool:
    """Rank 0 of a ``torch.distributed`` job, or a single process: the writers of the artifact."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
