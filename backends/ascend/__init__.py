"""Ascend lowering through ATC (``.om``) and msModelSlim's AscendV1 layout for vllm-ascend; the ``ascend`` target."""
from dataclasses import dataclass

from compiler.deploy.targets import Target, register_target
from compiler.options import option


def check_module(module: str, fmt: dict) -> str | None:
    """Why the vllm-ascend directory cannot hold ``module`` as ``fmt`` declares it (the .om takes any
    layer as its dequantized weight), or None."""
    if fmt.get("format") == "int8" and fmt.get("activation_scheme") == "dynamic" and not fmt.get("activation_symmetric"):
        return ("int8 dynamic asymmetric activations: vllm-ascend's W8A8_DYNAMIC is symmetric per token; set "
                "activation_symmetric = true (or activation_scheme = \"static\")")
    return None


def check_plan(plan) -> str | None:
    """A KV cache the lowering cannot carry: FP8 (refused by the .om and AscendV1), or an INT8 one C8 cannot hold."""
    from backends.ascend.msmodelslim import c8_refusal
    from compiler.deploy.targets import planned_kv_cache

    return c8_refusal(planned_kv_cache(plan), plan.config.head_dim if plan.config is not None else None)


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
    return lower_ascend(loaded, out, atc_opts, max_len, opts.atc, force)


register_target(Target("ascend", "Huawei Ascend via ATC .om (fp16), and a vllm-ascend (msModelSlim AscendV1) directory "
                                 "for INT8 / float artifacts",
                       check_module, _lower, AscendLowerOptions, check_plan))
