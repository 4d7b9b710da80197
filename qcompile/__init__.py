"""qcompile's Python API: load, compile, evaluate, inspect and lower LLM checkpoints.

    import qcompile

    result = qcompile.compile("smollm2", "examples/awq_g128.toml", "out/awq")   # an artifact
    model = qcompile.load("out/awq")              # artifact, HF dir, .gguf, or "smollm2"
    print(qcompile.evaluate(model)["ppl"])        # perplexity by the shared protocol
    print(qcompile.generate(model, "def fibonacci(n):", max_tokens=16))
    qcompile.lower("out/awq", "onnx", "out/awq-onnx").path   # what it wrote; .notes: what to know

Every user error raises ``compiler.errors.QCompileError`` (its message says what to do). The
command line (``qcompile``, ``python -m qcompile``) is built on these functions.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from compiler.deploy.targets import LowerResult
    from compiler.io.types import LoadedModel
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import CompileResult
    from serving.types import SamplingParams

__all__ = ["load", "compile", "evaluate", "generate", "inspect", "lower", "pipeline_config"]


def load_plugins() -> None:
    """Import the built-in passes and backends, which register themselves by name."""
    import backends  # noqa: F401
    import passes  # noqa: F401


def load(model: str | Path, dtype: str = "float32", allow_pickle: bool = False) -> "LoadedModel":
    """A runnable model and its tokenizer from an artifact, a HF directory, a ``.gguf`` file or a
    built-in name (``"smollm2"``). ``.model`` maps ``input_ids [B, T]`` to logits ``[B, T, V]``;
    artifacts keep the dtype they were compiled in, checkpoints load in ``dtype``."""
    from compiler.io.load import load_checkpoint

    load_plugins()
    return load_checkpoint(model, dtype, allow_pickle)


def pipeline_config(pipeline: "str | Path | dict | PipelineConfig") -> "PipelineConfig":
    """A validated-on-parse pipeline from a TOML path, a dict of the same shape, or itself."""
    from compiler.pipeline import PipelineConfig

    if isinstance(pipeline, PipelineConfig):
        return pipeline
    if isinstance(pipeline, dict):
        return PipelineConfig.from_dict(pipeline)
    return PipelineConfig.from_toml(pipeline)


def compile(model: "str | Path | LoadedModel", pipeline: "str | Path | dict | PipelineConfig", output: str | Path,
            force: bool = False, allow_pickle: bool = False, streaming: str = "auto",
            memory_limit: "int | str | None" = None) -> "CompileResult":
    """Run ``pipeline`` on ``model`` and write the artifact directory ``output`` (atomically).

    ``model`` is anything ``load`` takes, or an already loaded model (changed in place). The
    pipeline and its memory plan are validated as a whole before any pass runs; ``memory_limit``
    (bytes or "4GiB"; default what the machine allows) bounds it, and ``streaming`` ("auto",
    "on", "off") says whether the compile may run one decoder block at a time. Returns the
    artifact's path, the compiled model in memory (None when streamed) and each pass's report."""
    from compiler.io.types import LoadedModel
    from compiler.pipeline.compile import compile_loaded, compile_model
    from compiler.pipeline.memory import parse_size

    load_plugins()
    config = pipeline_config(pipeline)
    limit = parse_size(memory_limit) if isinstance(memory_limit, str) else memory_limit
    if isinstance(model, LoadedModel):
        return compile_loaded(model, config, output, force, limit)
    return compile_model(model, config, output, allow_pickle, force, streaming, limit)


def evaluate(model: "str | Path | LoadedModel", corpus: str = "pydoc", windows: int = 16,
             split: str = "evaluation", reference: "str | Path | LoadedModel | None" = None,
             save_reference: str | Path | None = None, plot: str | Path | None = None,
             runtimes: "list[str] | None" = None, runtime_dir: str | Path | None = None) -> dict:
    """Perplexity ``{"ppl", "tokens", "nll"}`` on the first ``windows`` 512-token windows of
    ``corpus`` (``"pydoc"``, a ``.txt`` file or folder, ``FILE.jsonl[:field]``): of its evaluation
    region (reported figures) or its validation region (for choosing settings).

    With ``reference`` (a model as ``load`` takes it, or a reference file), llama.cpp's
    KL-divergence statistics of ``model`` against it on the same windows instead, the dict that
    ``qcompile eval --reference --json`` prints: ``ppl``, ``ppl_base``, ``ln_ppl_ratio``,
    ``kld_mean``, ``kld_median``/``kld_90``/…, ``rms_dp``, ``same_top`` (each with ``_uncertainty``
    where it has one), ``tokens``. ``save_reference`` writes a reference model's file, reusable as
    ``reference``; ``plot`` draws the per-token KLD histogram to a PNG.

    With ``runtimes`` too (``["engine", "onnx", "vllm", "gguf", "triton"]``; ``model`` an artifact),
    those statistics for each runtime the artifact lowers to, as ``qcompile eval --runtimes``:
    ``{"runtimes": [{"runtime", "runs", "kl_over", statistics...} or {"runtime", "runs",
    "unavailable": why}], "corpus", ...}`` (``qcompile/eval_runtimes.py``); the lowered outputs go
    to ``runtime_dir`` (kept) or a temporary folder."""
    from compiler.pipeline.evaluate import check_reference_options, compare_to_reference, evaluate_perplexity, load_reference

    from compiler.io.types import LoadedModel

    check_reference_options(reference, save_reference, plot)
    if runtimes is not None:
        from qcompile.eval_runtimes import check_runtimes

        check_runtimes(runtimes, reference, plot)
    if reference is None:
        return evaluate_perplexity(_loaded(model), corpus, windows, split=split)
    candidate = _loaded(model)
    if not isinstance(reference, LoadedModel):
        load_plugins()
        reference = load_reference(reference)
    save = None if save_reference is None else Path(save_reference)
    if runtimes is not None:
        from qcompile.eval_runtimes import compare_runtimes

        return compare_runtimes(candidate, runtimes, reference, corpus, windows, split, save,
                                runtime_dir=None if runtime_dir is None else Path(runtime_dir))
    return compare_to_reference(candidate, reference, corpus, windows, split, save, None if plot is None else Path(plot))


def generate(model: "str | Path | LoadedModel", prompt: str, max_tokens: int = 64,
             params: "SamplingParams | None" = None, **sampling) -> str:
    """The completion of ``prompt`` by the reference decoder (the model as loaded, a contiguous KV
    cache), greedy unless asked otherwise: ``params`` (``serving.types.SamplingParams``, which then
    sets max_tokens too) or its fields as keywords (``temperature``, ``top_k``, ``top_p``, ``seed``,
    ``stop``, ``ignore_eos``). Sampling, stop strings and EOS are the serving engine's; for batched
    or streamed serving use ``serving.engine.Engine``."""
    from serving.reference import complete
    from serving.types import SamplingParams

    params = SamplingParams.of(params, **sampling) if params else SamplingParams.of(max_tokens=max_tokens, **sampling)
    loaded = _loaded(model)
    if loaded.tokenizer is None:
        from compiler.errors import ConfigError

        raise ConfigError("generate needs a tokenizer, and this model ships none")
    return complete(loaded.model, loaded.tokenizer, prompt, params)


def inspect(artifact: str | Path) -> dict:
    """An artifact's passes, formats, per-layer sizes and bits per weight (from its manifest)."""
    from compiler.io.summary import artifact_summary

    return artifact_summary(artifact)


def lower(artifact: str | Path, target: str, output: str | Path, force: bool = False, **options) -> "LowerResult":
    """Lower ``artifact`` for ``target`` (``onnx``, ``triton``, ``vllm``, ``gguf``, ``ascend``) into
    ``output``; ``options`` are the target's own (e.g. ``max_len=512`` for onnx, ``soc="Ascend910B3"``
    for ascend). Returns what it wrote (``.path``) and the target's ``.notes`` (what was rounded, what
    was left out and why), which ``qcompile lower`` prints."""
    from compiler.deploy.lowering import lower as lower_artifact

    load_plugins()
    return lower_artifact(artifact, target, output, options, force)


def _loaded(model: "str | Path | LoadedModel") -> "LoadedModel":
    from compiler.io.types import LoadedModel

    return model if isinstance(model, LoadedModel) else load(model)
