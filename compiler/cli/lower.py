"""``qcompile lower ARTIFACT --target T -o DIR``: turn an artifact into a deployable bundle.

Each target is one function registered with ``@register_lowering("name")``; the command checks
the artifact's formats against the target (``compiler.targets``) and dispatches. To add a
target, write a function ``(LowerRequest, Console) -> None`` and register it here.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.table import Table

from compiler.errors import ConfigError
from compiler.options import suggest


@dataclass(frozen=True)
class LowerRequest:
    """The command line, as every lowering sees it (target-specific options may be None)."""

    artifact: Path
    output: Path
    force: bool = False
    max_len: int | None = None  # None: min(1024, the model's max_seq_len)
    soc: str | None = None
    buckets: tuple[int, ...] | None = None
    atc: str | None = None
    precision_mode: str | None = None
    precision_mode_v2: str | None = None


LOWERINGS: dict[str, Callable[[LowerRequest, Console], None]] = {}


def register_lowering(target: str):
    """Decorator: ``@register_lowering("onnx")`` makes ``--target onnx`` call the function."""

    def wrap(fn):
        LOWERINGS[target] = fn
        return fn

    return wrap


DEFAULT_MAX_LEN = 1024


def _load(req: LowerRequest, target: str):
    """The artifact, checked against the target, and the cache length to lower with."""
    from compiler.artifact import load_artifact
    from compiler.targets import check_formats

    loaded = load_artifact(req.artifact)
    check_formats(target, loaded.manifest.get("modules", {}), str(req.artifact))
    return loaded, req.max_len or min(DEFAULT_MAX_LEN, loaded.model.config.max_seq_len)


def _print_layers(console: Console, title: str, layers: dict[str, str]) -> None:
    table = Table(title=title)
    table.add_column("exported as")
    table.add_column("layers", justify="right")
    counts: dict[str, int] = {}
    for how in layers.values():
        counts[how] = counts.get(how, 0) + 1
    for how, n in sorted(counts.items()):
        table.add_row(how, str(n))
    if layers:
        console.print(table)


@register_lowering("onnx")
def lower_onnx(req: LowerRequest, console: Console) -> None:
    from backends.onnx.export import OnnxExportOptions, default_dtype, export_onnx

    loaded, max_len = _load(req, "onnx")
    opts = OnnxExportOptions(max_len=max_len, dtype=default_dtype(loaded.model))
    info = export_onnx(loaded, req.output, opts, req.force)
    _print_layers(console, "quantized layers", info.layers)
    console.print(f"wrote [bold]{req.output}[/bold] (prefill.onnx + decode.onnx, {info.dtype}, KV cache max_len {info.max_len})")


@register_lowering("ascend")
def lower_ascend_cmd(req: LowerRequest, console: Console) -> None:
    from backends.ascend.atc import DEFAULT_BUCKETS, AtcOptions
    from backends.ascend.lower import lower_ascend

    if not req.soc:
        raise ConfigError("--target ascend needs --soc (the chip name from 'npu-smi info', e.g. Ascend910B3)")
    loaded, max_len = _load(req, "ascend")
    atc_opts = AtcOptions(req.soc, req.buckets or tuple(b for b in DEFAULT_BUCKETS if b <= max_len),
                          req.precision_mode, req.precision_mode_v2)
    result = lower_ascend(loaded, req.output, atc_opts, max_len, req.atc, req.force)
    for note in result.notes:
        console.print(f"note: {note}")
    console.print(f"wrote [bold]{result.bundle}[/bold]; .om: {', '.join(str(p) for p in result.om_files)}")


def parse_buckets(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.replace(";", ",").split(","))
    except ValueError:
        raise ConfigError(f"--buckets {text!r}: give sequence lengths like 128,256,512") from None


def lower_cmd(
    artifact: Path = typer.Argument(..., help="Artifact directory."),
    target: str = typer.Option(..., "--target", "-t", help="Deployment target (onnx, ascend, …)."),
    output: Path = typer.Option(..., "-o", "--output", help="Bundle directory to write."),
    max_len: Optional[int] = typer.Option(None, "--max-len", min=1, help="KV-cache length (prompt + generated tokens); default min(1024, the model's)."),
    soc: Optional[str] = typer.Option(None, "--soc", help="Ascend chip (npu-smi info), e.g. Ascend910B3."),
    buckets: Optional[str] = typer.Option(None, "--buckets", help="Ascend prefill length gears, e.g. 128,256,512."),
    atc: Optional[str] = typer.Option(None, "--atc", help="Path to atc (default: atc on PATH)."),
    precision_mode: Optional[str] = typer.Option(None, "--precision-mode", help="ATC --precision_mode (default force_fp16)."),
    precision_mode_v2: Optional[str] = typer.Option(None, "--precision-mode-v2", help="ATC --precision_mode_v2 instead."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output directory."),
):
    """Lower ARTIFACT to a deployable bundle for TARGET."""
    from compiler.cli import _load_plugins, out

    _load_plugins()
    if target not in LOWERINGS:
        raise ConfigError(f"unknown --target {target!r}{suggest(target, LOWERINGS)}")
    req = LowerRequest(artifact, output, force, max_len, soc, parse_buckets(buckets), atc, precision_mode, precision_mode_v2)
    LOWERINGS[target](req, out)
