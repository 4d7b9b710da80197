"""Ascend lowering through ATC (``.om``) with msModelSlim W4A16 weights, and the ``ascend`` target."""
from dataclasses import dataclass

from compiler.deploy.lowering import register_lowering
from compiler.deploy.targets import TargetSpec, register_target
from compiler.options import option


def _check(module: str, fmt: dict) -> str | None:
    # The .om runs fp16 (quantized layers dequantized); INT4 layers must also fit msModelSlim W4A16,
    # whose per-group layout has no padding: the group size must divide in_features.
    if fmt.get("format") == "int4" and "in_features" in fmt and fmt["in_features"] % fmt["group_size"]:
        return (f"msModelSlim W4A16 needs the group size {fmt['group_size']} to divide in_features "
                f"{fmt['in_features']}; choose a group size that divides it")
    return None


register_target(TargetSpec("ascend", "Huawei Ascend via ATC .om (fp16) + msModelSlim W4A16 weights", _check))


@dataclass(frozen=True)
class AscendLowerOptions:
    soc: str | None = option(None, "Chip name from 'npu-smi info', e.g. Ascend910B3 (required).")
    buckets: list[int] | None = option(None, "Prefill length gears, e.g. 128,256,512; default: the standard ones "
                                             "up to max_len.")
    atc: str | None = option(None, "Path to atc; default: atc on PATH.")
    precision_mode: str | None = option(None, "ATC --precision_mode (default force_fp16).")
    precision_mode_v2: str | None = option(None, "ATC --precision_mode_v2, instead of --precision_mode.")
    max_len: int | None = option(None, "KV-cache length of the graphs; default min(1024, the model's).")


def _lower(artifact, out, opts: AscendLowerOptions, force: bool):
    from backends.ascend.atc import DEFAULT_BUCKETS, AtcOptions
    from backends.ascend.lower import lower_ascend
    from compiler.deploy.lowering import load_for_target
    from compiler.errors import ConfigError

    if not opts.soc:
        raise ConfigError("--target ascend needs --soc (the chip name from 'npu-smi info', e.g. Ascend910B3)")
    loaded, max_len = load_for_target(artifact, "ascend", opts.max_len)
    buckets = tuple(opts.buckets) if opts.buckets else tuple(b for b in DEFAULT_BUCKETS if b <= max_len)
    atc_opts = AtcOptions(opts.soc, buckets, opts.precision_mode, opts.precision_mode_v2)
    return lower_ascend(loaded, out, atc_opts, max_len, opts.atc, force).bundle


register_lowering("ascend", _lower, AscendLowerOptions)
