"""``compile``: load a checkpoint, validate the pipeline, run its passes, write the artifact."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from compiler.deploy.targets import check_formats
from compiler.formats.qlinear import quantized_modules
from compiler.io.artifact import save_artifact
from compiler.io.load import load_checkpoint
from compiler.io.types import LoadedModel
from compiler.pipeline import PassContext, PassReport, Pipeline, PipelineConfig


@dataclass
class CompileResult:
    path: Path
    loaded: LoadedModel  # the compiled model, in memory
    reports: list[PassReport]  # this compile's passes (the manifest also holds an input artifact's)


def compile_loaded(loaded: LoadedModel, config: PipelineConfig, out: str | Path, force: bool = False) -> CompileResult:
    """Run ``config``'s passes on an already loaded model (modified in place) and write the artifact.

    When ``loaded`` is an artifact, its passes stay in the new manifest: its ``[[passes]]`` entries
    come before this pipeline's, its pass reports before this compile's, and with a ``[target]``
    the formats it already holds are checked as well as the planned ones. Under ``torchrun`` (a
    distributed pass) every rank runs the passes and rank 0 alone writes the artifact.
    """
    pipeline = Pipeline(config)
    planned = pipeline.validate(loaded.model.config)
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
    return CompileResult(path, loaded, reports)


def compile_model(model: str | Path, config: PipelineConfig, out: str | Path, allow_pickle: bool = False,
                  force: bool = False) -> CompileResult:
    """Compile checkpoint ``model`` with ``config`` into the artifact directory ``out``."""
    Pipeline(config)  # parse every pass's options before the (slow) load
    loaded = load_checkpoint(model, config.model.dtype, allow_pickle)
    return compile_loaded(loaded, config, out, force)


def _writes_artifact() -> bool:
    """Rank 0 of a ``torch.distributed`` job, or a single process: the writers of the artifact."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
