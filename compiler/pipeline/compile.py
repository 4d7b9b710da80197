"""``compile``: load a checkpoint, validate the pipeline, run its passes, write the artifact."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from compiler.io.artifact import save_artifact
from compiler.io.load import load_checkpoint
from compiler.io.types import LoadedModel
from compiler.pipeline import PassContext, PassReport, Pipeline, PipelineConfig


@dataclass
class CompileResult:
    path: Path
    loaded: LoadedModel  # the compiled model, in memory
    reports: list[PassReport]


def compile_loaded(loaded: LoadedModel, config: PipelineConfig, out: str | Path, force: bool = False) -> CompileResult:
    """Run ``config``'s passes on an already loaded model (modified in place) and write the artifact."""
    pipeline = Pipeline(config)
    pipeline.validate(loaded.model.config)
    context = PassContext(tokenizer=loaded.tokenizer, calibration=config.calibration, target=config.target.name)
    reports = pipeline.run(loaded.model, context)
    path = save_artifact(out, loaded.model, loaded.tokenizer, loaded.source, config.to_dict(),
                         [r.to_dict() for r in reports], context.manifest_extras, force)
    return CompileResult(path, loaded, reports)


def compile_model(model: str | Path, config: PipelineConfig, out: str | Path, allow_pickle: bool = False,
                  force: bool = False) -> CompileResult:
    """Compile checkpoint ``model`` with ``config`` into the artifact directory ``out``."""
    Pipeline(config)  # parse every pass's options before the (slow) load
    loaded = load_checkpoint(model, config.model.dtype, allow_pickle)
    return compile_loaded(loaded, config, out, force)
