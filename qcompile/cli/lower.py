"""``qcompile lower ARTIFACT --target T -o DIR``: one command for every target.

Each backend registers its lowering with ``compiler.deploy.lowering.register_lowering`` and parses the
options it understands into its own dataclass, so a flag that a target does not take (``--soc``
for onnx, say) is an error naming that target, not silently ignored.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from backends.onnx.bundle import BUNDLE_FILE, OnnxBundleInfo
from compiler.errors import ConfigError


def parse_buckets(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.replace(";", ",").split(",")]
    except ValueError:
        raise ConfigError(f"--buckets {text!r}: give sequence lengths like 128,256,512") from None


def lower_cmd(
    artifact: Path = typer.Argument(..., help="Artifact directory (from 'qcompile compile')."),
    target: str = typer.Option(..., "--target", "-t", help="Deployment target: onnx, ascend or triton."),
    output: Path = typer.Option(..., "-o", "--output", help="Folder to write (bundle, or Triton model repository)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output folder."),
    max_len: Optional[int] = typer.Option(None, "--max-len", min=1, help="onnx/ascend: KV-cache length; default min(1024, the model's)."),
    accuracy_level: Optional[int] = typer.Option(None, "--accuracy-level", help="onnx: MatMulNBits accuracy_level, 0 (the model's float type) .. 4 (int8 compute, the default)."),
    soc: Optional[str] = typer.Option(None, "--soc", help="ascend: chip name from 'npu-smi info', e.g. Ascend910B3."),
    buckets: Optional[str] = typer.Option(None, "--buckets", help="ascend: prefill length gears, e.g. 128,256,512."),
    atc: Optional[str] = typer.Option(None, "--atc", help="ascend: path to atc (default: atc on PATH)."),
    precision_mode: Optional[str] = typer.Option(None, "--precision-mode", help="ascend: ATC --precision_mode (default force_fp16)."),
    precision_mode_v2: Optional[str] = typer.Option(None, "--precision-mode-v2", help="ascend: ATC --precision_mode_v2 instead."),
    device: Optional[str] = typer.Option(None, help="triton: cpu (KIND_CPU), cuda (KIND_GPU, H100 kernels) or npu (Ascend)."),
    name: Optional[str] = typer.Option(None, help="triton: model name in the repository (default: the artifact's folder name)."),
    instances: Optional[int] = typer.Option(None, help="triton: model instances (each holds one engine)."),
):
    """Lower ARTIFACT to a deployable bundle for TARGET."""
    from compiler.deploy.lowering import lower
    from qcompile import load_plugins
    from qcompile.cli.console import out

    load_plugins()
    flags = {"max_len": max_len, "accuracy_level": accuracy_level, "soc": soc, "buckets": parse_buckets(buckets), "atc": atc,
             "precision_mode": precision_mode,
             "precision_mode_v2": precision_mode_v2, "device": device, "name": name, "instances": instances}
    path = lower(artifact, target, output, {k: v for k, v in flags.items() if v is not None}, force)
    if (Path(path) / BUNDLE_FILE).exists():
        _print_bundle(out, OnnxBundleInfo.read(path))
    out.print(f"wrote [bold]{path}[/bold] (target {target})")


def _print_bundle(console, info) -> None:
    """How each layer was exported (ONNX/Ascend bundles), and the target's notes."""
    counts = Counter(info.layers.values())
    if counts:
        table = Table(title="layers")
        table.add_column("exported as")
        table.add_column("layers", justify="right")
        for how, n in sorted(counts.items()):
            table.add_row(how, str(n))
        console.print(table)
    for note in info.extras.get("notes", []):
        console.print(f"note: {note}")
