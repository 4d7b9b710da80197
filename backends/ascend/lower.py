"""``qcompile lower --target ascend``: ATC-ready ONNX, msModelSlim weights, build_om.sh, the .om.

Order matters:
  0. refuse what the .om would not run as the artifact declares it: an FP8 KV cache (ATC compiles
     the graphs at fp16 precision, so the exact FP8 rounding the ONNX graphs carry would not
     survive it), a manifest entry this lowering does not know, a serving plan's other KV dtype;
  1. build the fp16 graphs in memory (static batch 1; prefill length as ATC gears; every
     quantized layer as a MatMul of its dequantized weight, since ATC takes no MatMulNBits);
  2. check every node against ATC's operator table — before anything is written;
  3. write the bundle atomically: graphs, bundle.json, build_om.sh, and for INT4 artifacts the
     msModelSlim W4A16 weights that MindIE / vllm-ascend load;
  4. run build_om.sh when ATC is available, else stop with ``AtcNotFound`` (exit 3).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from backends.ascend.atc import (
    SCRIPT,
    AtcNotFound,
    AtcOptions,
    build_script,
    find_atc,
    run_atc,
)
from backends.ascend.msmodelslim import export_w4a16
from backends.ascend.ops import require_supported
from backends.onnx.export import (
    OnnxExportOptions,
    bundle_info,
    export_graphs,
    lowered_entries,
    write_bundle_files,
)
from backends.onnx.kv_rounding import kv_cache_export
from compiler.errors import ConfigError
from compiler.formats.int4 import Int4Linear
from compiler.formats.qlinear import quantized_modules
from compiler.io.atomic import atomic_directory_write
from compiler.io.types import LoadedModel


@dataclass
class AscendLowerResult:
    """What was written; ``om_files`` is empty when ATC did not run."""

    bundle: Path
    notes: list[str] = field(default_factory=list)
    om_files: list[Path] = field(default_factory=list)
    msmodelslim: bool = False


def refuse_fp8_kv_cache(loaded: LoadedModel) -> None:
    """The .om keeps K/V in fp16: an artifact whose K/V are rounded through FP8 cannot be lowered as it is."""
    if kv_cache_export(loaded.model) is not None or (loaded.manifest or {}).get("kv_cache"):
        raise ConfigError(f"{loaded.source.path}: the artifact has an FP8 KV cache, which the Ascend lowering does not "
                          "lower (ATC builds the graphs at fp16 precision, so FP8 rounding of K/V would not be exact); "
                          "lower it to onnx or triton, or compile it without kv_cache_dtype for Ascend")


def lower_ascend(loaded: LoadedModel, out: str | Path, atc_opts: AtcOptions, max_len: int = 1024,
                 atc: str | None = None, force: bool = False) -> AscendLowerResult:
    """Lower ``loaded`` for Ascend; raises AtcNotFound (after writing the bundle) without ATC."""
    out = Path(out)
    refuse_fp8_kv_cache(loaded)
    lowered_entries(loaded, "ascend", {"float16"})
    atc_opts.validate(max_len)
    atc_path = find_atc(atc)
    export = OnnxExportOptions(max_len=max_len, dtype="float16", batch=1, dequantize=True)
    prefill, decode = export_graphs(loaded.model, export)
    graphs = {"prefill": prefill, "decode": decode}
    require_supported(graphs)

    quantized = quantized_modules(loaded.model)
    int4 = any(isinstance(m, Int4Linear) for m in quantized.values())
    result = AscendLowerResult(out, msmodelslim=int4)
    if quantized:
        result.notes.append(f"{len(quantized)} quantized layer(s) are fp16 in the .om, built from their dequantized weights")
    if int4:
        result.notes.append("INT4 weights also written in msModelSlim W4A16 layout for MindIE / vllm-ascend")
    extras = {"soc": atc_opts.soc, "buckets": list(atc_opts.buckets), "atc": asdict(atc_opts), "notes": result.notes}
    info = bundle_info(loaded, export, "ascend", extras)

    def write(tmp: Path) -> None:
        write_bundle_files(tmp, loaded, (prefill, decode), info)
        (tmp / SCRIPT).write_text(build_script(atc_opts))
        os.chmod(tmp / SCRIPT, 0o755)
        if int4:
            export_w4a16(loaded.model, tmp)

    atomic_directory_write(out, write, force)
    if atc_path is None:
        raise AtcNotFound(f"wrote the Ascend bundle {out} but found no atc (CANN) here; on a CANN host run "
                          f"'bash {out / SCRIPT}', or rerun with --atc PATH")
    result.om_files = run_atc(out, atc_path, graphs)
    return result
