"""INT4 weights in msModelSlim's W4A16 per-group layout (what MindIE and vllm-ascend load).

    quant_model_weight_w4a16.safetensors
      model.layers.N.….weight         int8  [N, K]          signed 4-bit codes q - 8 in [-8, 7],
                                                            one per int8 (msModelSlim's export
                                                            layout; loaders pack them on the NPU)
      model.layers.N.….weight_scale   float32 [N, K // g]   per-group scale
      model.layers.N.….weight_offset  float32 [N, K // g]   per-group offset, so that
                                                            w = (code + offset) * scale
                                                            (the antiquant convention of
                                                            npu_weight_quant_batchmatmul)
      model.layers.N.….bias           float [N]             when the layer has one
      every other tensor              float, its HF name    embeddings, norms, float layers
    quant_model_description_w4a16.json
      {"model_quant_type": "W4A16", "group_size": g, "<tensor name>": "W4A16" | "FLOAT", …}

With our zero point z (uint8, 0..15): code = q - 8 and offset = 8 - z, since
(q - z) * s = ((q - 8) + (8 - z)) * s. The group size must divide in_features (no padding).
Layers in other quantized formats (e.g. FP8) have no W4A16 form and are written as their
dequantized float weight, tagged FLOAT.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from compiler.errors import ArtifactError, ConfigError
from compiler.formats.int4 import Int4Linear
from compiler.formats.qlinear import QuantizedLinear
from compiler.model.transformer import Transformer
from compiler.quant.int4 import SYMMETRIC_ZERO

WEIGHT_FILE = "quant_model_weight_w4a16.safetensors"
DESCRIPTION_FILE = "quant_model_description_w4a16.json"
QUANT_TYPE = "W4A16"


def hf_name(name: str) -> str:
    """Our module names are Hugging Face's without the ``model.`` prefix (lm_head has none)."""
    return name if name.startswith("lm_head") else f"model.{name}"


def w4a16_tensors(module: Int4Linear) -> dict[str, torch.Tensor]:
    if module.in_features % module.group_size:
        raise ConfigError(f"msModelSlim W4A16 needs the group size ({module.group_size}) to divide in_features "
                          f"({module.in_features}); recompile with a group size that divides it")
    codes, zeros = module.codes()
    return {"weight": (codes.to(torch.int16) - SYMMETRIC_ZERO).to(torch.int8).contiguous(),
            "weight_scale": module.scales.float().contiguous(),
            "weight_offset": (SYMMETRIC_ZERO - zeros.to(torch.float32)).contiguous()}


def export_w4a16(model: Transformer, directory: Path) -> dict:
    """Write both files into ``directory``; returns the description."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    description: dict = {"model_quant_type": QUANT_TYPE}
    groups = set()
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    for name, module in quantized.items():
        prefix = hf_name(name)
        if isinstance(module, Int4Linear):
            groups.add(module.group_size)
            for suffix, t in w4a16_tensors(module).items():
                tensors[f"{prefix}.{suffix}"] = t
                description[f"{prefix}.{suffix}"] = QUANT_TYPE
        else:
            tensors[f"{prefix}.weight"] = module.dequantized_weight().detach().contiguous()
            description[f"{prefix}.weight"] = "FLOAT"
        bias = module.dequantized_bias()
        if bias is not None:
            tensors[f"{prefix}.bias"] = bias.detach().contiguous()
            description[f"{prefix}.bias"] = "FLOAT"
    skip = tuple(f"{n}." for n in quantized)
    seen = set()
    for name, t in model.state_dict().items():
        if name.startswith(skip) or t.data_ptr() in seen:  # tied lm_head shares the embedding
            continue
        seen.add(t.data_ptr())
        tensors[hf_name(name)] = t.detach().contiguous()
        description[hf_name(name)] = "FLOAT"
    if len(groups) > 1:
        raise ConfigError(f"msModelSlim W4A16 has one group size per model; this artifact mixes {sorted(groups)}")
    if groups:
        description["group_size"] = groups.pop()
    save_file(tensors, str(directory / WEIGHT_FILE))
    (directory / DESCRIPTION_FILE).write_text(json.dumps(description, indent=1))
    return description


def load_w4a16(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every weight of a W4A16 export as float: quantized layers dequantized, others as stored."""
    from safetensors.torch import load_file

    directory = Path(directory)
    try:
        description = json.loads((directory / DESCRIPTION_FILE).read_text())
        tensors = load_file(str(directory / WEIGHT_FILE))
    except FileNotFoundError as e:
        raise ArtifactError(f"{directory}: missing {Path(e.filename).name}; not an msModelSlim W4A16 export") from None
    if description.get("model_quant_type") != QUANT_TYPE:
        raise ArtifactError(f"{directory / DESCRIPTION_FILE}: model_quant_type is {description.get('model_quant_type')!r}, expected W4A16")
    group = description.get("group_size")
    out = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_offset")):
            continue
        if description.get(name) == QUANT_TYPE:
            prefix = name.removesuffix(".weight")
            scale, offset = tensors[f"{prefix}.weight_scale"], tensors[f"{prefix}.weight_offset"]
            n, k = t.shape
            w = (t.float().view(n, k // group, group) + offset[..., None]) * scale[..., None]
            out[name] = w.view(n, k)
        else:
            out[name] = t
    return out
