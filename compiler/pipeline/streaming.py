"""Streamed compile: a model bigger than memory, one decoder block at a time.

The checkpoint stays on disk (``compiler.io.stream``: safetensors or GGUF). The embeddings, final
norm and lm_head are loaded once; then, for each decoder block in turn, the block is
materialised, the pipeline's block pass calibrates and converts it (``BlockStream.block``; its
calibration activations flow on to the next block), its tensors are spooled to the artifact's
temp directory and the block is dropped before the next one is read. At the end the manifest is
built and the weights are laid out in the model's state-dict order into the same (sharded)
files ``save_artifact`` writes, through the same code (``finish_artifact``), so a streamed and an
in-memory compile of one model write the same bytes; the whole directory is renamed into place
at once (``atomic_directory_write``).

What can stream (``streaming_blocker``): a HF checkpoint with safetensors weights or a GGUF file
(its tensors read and dequantized one by one), and a pipeline
whose passes have scope "block" (one at most: AWQ, or FP8 without lm_head) or "config" (no
weights: paged_kv); a pass of scope "model" (distill) needs the whole model, and its memory is
planned as such.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compiler.formats.qlinear import quantized_modules
from compiler.io.artifact import ArtifactRecord, dedupe_shared, finish_artifact
from compiler.io.atomic import atomic_directory_write
from compiler.io.shards import ShardWriter
from compiler.io.load import Checkpoint
from compiler.io.stream import BlockReader, open_streamed, release_freed_memory
from compiler.io.types import parse_dtype
from compiler.model.transformer import DecoderLayer, Transformer
from compiler.pipeline import CompilePlan, PassContext, PassReport, Pipeline
from compiler.progress import track


def streaming_blocker(pipeline: Pipeline, plan: CompilePlan, checkpoint: Checkpoint) -> str | None:
    """Why a compile of ``checkpoint`` with ``pipeline`` (validated into ``plan``) cannot stream, or
    None when it can."""
    path = checkpoint.path
    if checkpoint.kind == "artifact":
        return f"{path.name} is not a Hugging Face checkpoint directory or a GGUF file (artifacts load whole)"
    safetensors = ("model.safetensors", "model.safetensors.index.json")
    if checkpoint.kind == "hf" and not any((path / name).exists() for name in safetensors):
        return f"{path.name} holds no safetensors weights"
    scopes = [(p.name, p.scope(plan.meta)) for p in pipeline.passes]
    whole = [name for name, scope in scopes if scope == "model"]
    if whole:
        return f"pass {whole[0]} needs the whole model in memory"
    blocks = [name for name, scope in scopes if scope == "block"]
    if len(blocks) > 1:
        return f"passes {', '.join(blocks)} each convert weights; a streamed compile runs one such pass"
    return None


def compile_streamed(checkpoint: Checkpoint, pipeline: Pipeline, plan: CompilePlan, out: Path,
                     force: bool = False) -> list[PassReport]:
    """Run ``pipeline`` (validated into ``plan``, streamable) over ``checkpoint`` block by block and
    write the artifact ``out``; returns the passes' reports."""
    config = pipeline.config
    reader = open_streamed(checkpoint, parse_dtype(config.model.dtype))
    reports: list[PassReport] = []

    def write(tmp: Path):
        shell = reader.shell()
        context = PassContext(tokenizer=reader.tokenizer, calibration=config.calibration, target=config.target.name,
                              plan=plan)
        writer = ShardWriter(tmp, spool=True)
        blocks = _run_and_spool(pipeline, shell, reader, context, writer, reports)
        # The head (embeddings, norm, lm_head) goes where the model's state dict puts it: around the blocks.
        full = shell.state_dict()  # the blocks in it are on the meta device now
        keys = list(full)
        first_block = next(i for i, k in enumerate(keys) if k.startswith("layers."))
        before, after = keys[:first_block], [k for k in keys[first_block:] if not k.startswith("layers.")]
        head_state, head_aliases = dedupe_shared({k: full[k] for k in before + after})
        for name, t in head_state.items():
            writer.add(name, t)
        order = [k for k in before if k in head_state] + blocks.names + [k for k in after if k in head_state]
        every_key = before + blocks.keys + after
        aliases = {**blocks.aliases, **head_aliases}
        aliases = dict(sorted(aliases.items(), key=lambda kv: every_key.index(kv[0])))
        head_modules = {n: m.format_meta() for n, m in quantized_modules(shell).items() if not n.startswith("layers.")}
        modules = {**{n: f for n, f in head_modules.items() if n in {k.rpartition(".")[0] for k in before}},
                   **blocks.modules, **head_modules}
        recipe = {**config.to_dict(), "passes": list(config.passes)}
        record = ArtifactRecord(shell.config, shell.embed_tokens.weight.dtype, reader.source, recipe,
                                [r.to_dict() for r in reports], context.manifest_extras)
        finish_artifact(tmp, writer, order, aliases, modules, record, reader.tokenizer)

    atomic_directory_write(out, write, force)
    return reports


@dataclass
class _Spooled:
    """What the blocks put into the artifact: tensor names (spooled), every state-dict key
    (aliases too), aliases and converted modules, in model order."""

    names: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    modules: dict[str, dict] = field(default_factory=dict)


def _run_and_spool(pipeline: Pipeline, shell: Transformer, reader: BlockReader, context: PassContext,
                   writer: ShardWriter, reports: list[PassReport]) -> _Spooled:
    """Run the passes in order, the block pass over each block as it is read, and spool every
    block's tensors."""
    config = shell.config
    scopes = [p.scope(context.plan.meta) for p in pipeline.passes]
    streamed = scopes.index("block") if "block" in scopes else None
    for i in range(len(pipeline.passes)) if streamed is None else range(streamed):
        reports.append(_run_whole(pipeline, i, shell, context))
    stream, seconds = None, 0.0
    if streamed is not None:
        start = time.perf_counter()
        with pipeline.failures(streamed, context):
            stream = pipeline.passes[streamed].stream(shell, context)
        seconds += time.perf_counter() - start
    spooled = _Spooled()
    for index in track(range(config.n_layers), "streaming blocks", total=config.n_layers):
        shell.layers[index] = reader.block(index)
        if stream is not None:
            start = time.perf_counter()
            with pipeline.failures(streamed, context):
                stream.block(index)
            seconds += time.perf_counter() - start
        _spool_block(shell, index, writer, spooled)
        release_freed_memory()
    if stream is not None:
        start = time.perf_counter()
        with pipeline.failures(streamed, context):
            report = stream.finish()
        reports.append(pipeline.record(streamed, report, seconds + time.perf_counter() - start, context))
        for i in range(streamed + 1, len(pipeline.passes)):
            reports.append(_run_whole(pipeline, i, shell, context))
    return spooled


def _spool_block(shell: Transformer, index: int, writer: ShardWriter, spooled: _Spooled) -> None:
    """Spool block ``index``'s tensors and put an empty block in its place; the block's memory
    goes with the last reference, which this function's locals are (so the next block is read
    with none of this one left)."""
    block, prefix = shell.layers[index], f"layers.{index}."
    full = block.state_dict()
    state, aliases = dedupe_shared(full)
    for name, t in state.items():
        writer.add(prefix + name, t)
        spooled.names.append(prefix + name)
    spooled.keys += [prefix + k for k in full]
    spooled.aliases.update({prefix + a: prefix + b for a, b in aliases.items()})
    spooled.modules.update({prefix + n: m.format_meta() for n, m in quantized_modules(block).items()})
    with torch.device("meta"):
        shell.layers[index] = DecoderLayer(shell.config, index)


def _run_whole(pipeline: Pipeline, i: int, shell: Transformer, context: PassContext) -> PassReport:
    """A pass of scope "config": it reads the config and dtype, which the shell holds."""
    start = time.perf_counter()
    with pipeline.failures(i, context):
        report = pipeline.passes[i].run(shell, context)
    return pipeline.record(i, report, time.perf_counter() - start, context)
