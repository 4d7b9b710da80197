"""Ascend lowering through ATC (``.om``) with msModelSlim W4A16 weights, and the ``ascend`` target."""
from compiler.targets import TargetSpec, register_target


def _check(module: str, fmt: dict) -> str | None:
    # The .om runs fp16 (quantized layers dequantized); INT4 layers must also fit msModelSlim W4A16,
    # whose per-group layout has no padding: the group size must divide in_features.
    if fmt.get("format") == "int4" and "in_features" in fmt and fmt["in_features"] % fmt["group_size"]:
        return (f"msModelSlim W4A16 needs the group size {fmt['group_size']} to divide in_features "
                f"{fmt['in_features']}; choose a group size that divides it")
    return None


register_target(TargetSpec("ascend", "Huawei Ascend via ATC .om (fp16) + msModelSlim W4A16 weights", _check))
