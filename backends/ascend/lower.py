"""``qcompile lower --target ascend``: ATC-ready ONNX, build_om.sh, the .om, and the vllm-ascend directory.

Order matters:
  0. refuse what the .om would not run as the artifact declares it: an FP8 KV cache (ATC compiles
     the graphs at fp16 precision, so the exact FP8 rounding the ONNX graphs carry would not
     survive it), a manifest entry this lowering does not know, a serving plan's other KV dtype.
     An INT8 KV cache is lowered: vllm-ascend's C8 holds its scales, and the .om graphs round K/V
     through int8 at fp16 precision (a note says so);
  1. build the fp16 graphs in memory (static batch 1; prefill length as ATC gears; every
     quantized layer as a MatMul of its dequantized weight, since ATC takes no MatMulNBits);
  2. check every node against ATC's operator table — before anything is written;
  3. write the bundle atomically: graphs, bundle.json, build_om.sh, and ``vllm-ascend/``: the
     artifact in msModelSlim's AscendV1 layout, which vllm-ascend serves (its INT8 layers as
     W8A8 / W8A8_DYNAMIC / W8A16; float models all FLOAT). Artifacts with layers of no AscendV1
     form (INT4, FP8, GGUF) or experts get none, and a note says why;
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
from backends.ascend.msmodelslim import (
    DIRECTORY,
    ascend_v1_skip,
    check_ascend_v1,
    prepare_ascend_v1,
)
from backends.ascend.ops import require_supported
from backends.onnx.export import (
    OnnxExportOptions,
    bundle_info,
    export_graphs,
    layer_counts,
    lowered_entries,
    write_bundle_files,
)
from backends.onnx.kv_rounding import kv_cache_export
from compiler.deploy.targets import LowerResult
from compiler.errors import ConfigError
from compiler.formats.kv_quant import Fp8KVQuant
from compiler.formats.qlinear import quantized_modules
from compiler.io.atomic import atomic_directory_write
from compiler.io.types import LoadedModel
from compiler.quant.fp8 import FP8_DTYPES


@dataclass
class AscendLowerResult(LowerResult):
    """What was written (``path``: the bundle); ``om_files`` is empty when ATC did not run; ``vllm_ascend``
    is the AscendV1 directory, None when the artifact has no AscendV1 form (the notes say why)."""

    om_files: list[Path] = field(default_factory=list)
    vllm_ascend: Path | None = None


def refuse_fp8_kv_cache(loaded: LoadedModel) -> None:
    """The .om keeps K/V in fp16: an artifact whose K/V are rounded through FP8 cannot be lowered as it is."""
    declared = ((loaded.manifest and loaded.manifest.kv_cache) or {}).get("dtype")
    if isinstance(loaded.model.layers[0].self_attn.kv_quant, Fp8KVQuant) or declared in FP8_DTYPES:
        raise ConfigError(f"{loaded.source.path}: the artifact has an FP8 KV cache, which the Ascend lowering does not "
                          "lower (ATC builds the graphs at fp16 precision, so FP8 rounding of K/V would not be exact); "
                          "lower it to onnx or triton, or compile it without kv_cache_dtype for Ascend")


def lower_ascend(loaded: LoadedModel, out: str | Path, atc_opts: AtcOptions, max_len: int = 1024,
                 atc: str | None = None, force: bool = False) -> AscendLowerResult:
    """Lower ``loaded`` for Ascend; raises AtcNotFound (after writing the bundle, which it carries) without ATC."""
    out = Path(out)
    refuse_fp8_kv_cache(loaded)
    lowered_entries(loaded, "ascend", {"float16"})
    skip = ascend_v1_skip(loaded)
    if skip is None:
        check_ascend_v1(loaded)
    atc_opts.validate(max_len)
    atc_path = find_atc(atc)
    export = OnnxExportOptions(max_len=max_len, dtype="float16", batch=1, dequantize=True)
    prefill, decode = export_graphs(loaded.model, export)
    graphs = {"prefill": prefill, "decode": decode}
    require_supported(graphs)

    quantized = quantized_modules(loaded.model)
    result = AscendLowerResult(out, vllm_ascend=None if skip else out / DIRECTORY)
    if quantized:
        result.notes.append(f"{len(quantized)} quantized layer(s) are fp16 in the .om, built from their dequantized weights")
    if kv_cache_export(loaded.model) is not None:  # an INT8 KV cache (FP8 ones were refused)
        result.notes.append("the .om graphs round K/V through int8 as the artifact does, at ATC's fp16 precision "
                            "(codes may differ where K / scale lies near half-way)"
                            + ("" if skip else f"; {DIRECTORY}/ holds the INT8 KV cache as vllm-ascend's C8"))
    if skip:
        result.notes.append(f"no {DIRECTORY}/ directory: {skip}")
    else:
        v1 = prepare_ascend_v1(loaded)
        result.notes.append(f"{DIRECTORY}/: the artifact in msModelSlim's AscendV1 layout "
                            f"({v1.description['model_quant_type']}) for vllm-ascend: vllm serve {out / DIRECTORY}")
        result.notes += v1.notes
    extras = {"soc": atc_opts.soc, "buckets": list(atc_opts.buckets), "atc": asdict(atc_opts), "notes": result.notes}
    info = bundle_info(loaded, export, "ascend", extras)
    result.layers = layer_counts(info)

    def write(tmp: Path) -> None:
        write_bundle_files(tmp, loaded, (prefill, decode), info)
        (tmp / SCRIPT).write_text(build_script(atc_opts))
        os.chmod(tmp / SCRIPT, 0o755)
        if skip is None:
            v1.write(tmp / DIRECTORY)

    atomic_directory_write(out, write, force)
    if atc_path is None:
        raise AtcNotFound(f"wrote the Ascend bundle {out} but found no atc (CANN) here; on a CANN host run "
                          f"'bash {out / SCRIPT}', or rerun with --atc PATH", result)
    result.om_files = run_atc(out, atc_path, graphs)
    return result
