"""Serving-time fusion of the projections that read one input: q/k/v, and gate/up.

At one decode token the small projections cost more in dispatch than in arithmetic (SmolLM2's
k_proj is 576 -> 192), so one matmul of N = Nq + Nk + Nv replaces three, and one of 2 x width
replaces gate and up — as vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` do. The
outputs are the same numbers (each output row is still one dot product over the same weights).

Only the engine fuses (``ServingPlan.fuse_projections``): artifacts, exports and passes keep
Hugging Face's modules, one per projection. A set is fused when its members are all
``nn.Linear``, all ``Int4Linear`` with one layout (group size, zero point, width, dtype, bias), or
all ``Fp8Linear`` that quantize their (shared) input the same way — one activation scheme, and the
same input scale, input shift and outlier channels, as the fp8 pass calibrates them on the same
input; their weight codes are kept and per-tensor weight scales become the rows' per-channel ones —
or all ``Int8Linear`` of one scheme with the same static input scale and zero point (the int8 pass
calibrates them on the same input).
Anything else stays as it is, and ``fuse_projections`` says why.
"""
from __future__ import annotations

import re
from dataclasses import replace

import torch
import torch.nn as nn

from compiler.formats.fp8 import Fp8Linear
from compiler.formats.int4 import Int4Linear
from compiler.formats.int8 import Int8Linear
from compiler.model.layers import MLP, Attention

ATTENTION_SET = ("q_proj", "k_proj", "v_proj")
MLP_SET = ("gate_proj", "up_proj")


def fused_unit(name: str) -> str:
    """The one layer vLLM (and this engine) runs module ``name`` as: a block's q/k/v ``….qkv``, its
    gate/up ``….gate_up``, a MoE layer's experts ``….experts``; any other module is its own. The
    members of a unit take one scheme."""
    name = re.sub(r"\.experts\.\d+\.\w+$", ".experts", name)
    name = re.sub(rf"\.({'|'.join(ATTENTION_SET)})$", ".qkv", name)
    return re.sub(rf"\.({'|'.join(MLP_SET)})$", ".gate_up", name)


def _layout(m: nn.Module) -> tuple | None:
    """What must agree for modules to be concatenated along their outputs, or None if the type never is."""
    has_bias = m.bias is not None
    if type(m) is nn.Linear:
        return ("float", m.in_features, m.weight.dtype, m.weight.device, has_bias)
    if type(m) is Int4Linear:
        return ("int4", m.in_features, m.group_size, m.zero_point, m.n_blocks, m.scales.dtype, m.scales.device, has_bias)
    if type(m) is Fp8Linear:
        # granularity and out_features may differ: the fused rows keep their own scales
        fmt = {k: v for k, v in m.format.to_dict().items() if k not in ("out_features", "granularity")}
        return ("fp8", tuple(sorted(fmt.items())), m.weight.device, has_bias, None if m.bias is None else m.bias.dtype,
                None if m.outlier_weight is None else m.outlier_weight.dtype)
    if type(m) is Int8Linear:
        fmt = {k: v for k, v in m.format.to_dict().items() if k != "out_features"}
        return ("int8", tuple(sorted(fmt.items())), m.weight.device, has_bias, None if m.bias is None else m.bias.dtype)
    return None


# The calibrated buffers that say how a layer quantizes its input (each format has some of them).
INPUT_BUFFERS = ("input_scale", "input_shift", "outlier_index", "input_zero_point")


def _same_input_quantization(modules: list[Fp8Linear] | list[Int8Linear]) -> bool:
    """Whether the members' calibrated input buffers agree, so quantizing the input once serves all."""
    first = modules[0]
    return all(a is None and b is None or a is not None and b is not None and torch.equal(a, b)
               for m in modules[1:] for a, b in ((getattr(first, n, None), getattr(m, n, None)) for n in INPUT_BUFFERS))


def concat_fp8(modules: list[Fp8Linear]) -> Fp8Linear:
    """One Fp8Linear whose rows are the members' rows: codes as they are, one scale per row."""
    first = modules[0]
    fmt = replace(first.format, out_features=sum(m.out_features for m in modules), granularity="per_channel")
    dtype = next((t.dtype for t in (first.bias, first.outlier_weight) if t is not None), torch.float32)
    fused = Fp8Linear(fmt, first.bias is not None, dtype).to(first.weight.device)
    fused.weight.copy_(torch.cat([m.weight for m in modules]))
    fused.weight_scale.copy_(torch.cat([m.weight_scale.expand(m.out_features) for m in modules]))
    for name in ("input_scale", "input_shift", "outlier_index"):
        if getattr(first, name) is not None:
            getattr(fused, name).copy_(getattr(first, name))
    for name in ("bias", "outlier_weight"):
        if getattr(first, name) is not None:
            getattr(fused, name).copy_(torch.cat([getattr(m, name) for m in modules]))
    return fused


def concat_int8(modules: list[Int8Linear]) -> Int8Linear:
    """One Int8Linear whose rows are the members' rows (codes and per-channel scales as they are)."""
    first = modules[0]
    fmt = replace(first.format, out_features=sum(m.out_features for m in modules))
    fused = Int8Linear(fmt, first.bias is not None, torch.float32 if first.bias is None else first.bias.dtype)
    fused = fused.to(first.weight.device)
    for name in ("weight", "weight_scale", "bias"):
        if getattr(first, name) is not None:
            getattr(fused, name).copy_(torch.cat([getattr(m, name) for m in modules]))
    for name in ("input_scale", "input_zero_point"):
        if getattr(first, name) is not None:
            getattr(fused, name).copy_(getattr(first, name))
    return fused


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if parts[0] is None else torch.cat(parts)


def concat_linears(modules: list[nn.Module]) -> tuple[nn.Module | None, str | None]:
    """(one module computing every member's output side by side, None) or (None, why not)."""
    layouts = [_layout(m) for m in modules]
    if any(layout is None for layout in layouts):
        kinds = sorted({type(m).__name__ for m, layout in zip(modules, layouts) if layout is None})
        return None, f"{', '.join(kinds)} projections are not fused"
    if len(set(layouts)) > 1:
        return None, "its projections differ in format or layout"
    first = modules[0]
    if layouts[0][0] in ("fp8", "int8"):
        if not _same_input_quantization(modules):
            return None, f"its {layouts[0][0]} projections quantize their input differently"
        return (concat_fp8 if layouts[0][0] == "fp8" else concat_int8)(modules), None
    if layouts[0][0] == "float":
        fused = nn.Linear(first.in_features, sum(m.out_features for m in modules), bias=first.bias is not None,
                          device="meta")
        fused.weight = nn.Parameter(torch.cat([m.weight.detach() for m in modules]), requires_grad=False)
        if first.bias is not None:
            fused.bias = nn.Parameter(torch.cat([m.bias.detach() for m in modules]), requires_grad=False)
        return fused, None
    return Int4Linear(first.in_features, sum(m.out_features for m in modules), first.group_size, first.zero_point,
                      torch.cat([m.qweight for m in modules]), torch.cat([m.scales for m in modules]),
                      torch.cat([m.qzeros for m in modules]), _cat([m.bias for m in modules])), None


@torch.no_grad()
def fuse_projections(model: nn.Module) -> dict[str, list[str]]:
    """Fuse every dense attention's q/k/v and every gated MLP's gate/up in place (the originals are
    removed, so no weight is held twice). Returns {"fused": [module names], reason: [module names]}."""
    outcome: dict[str, list[str]] = {"fused": []}
    for name, module in model.named_modules():
        if isinstance(module, Attention) and module.qkv_proj is None:
            fused, why = concat_linears([getattr(module, p) for p in ATTENTION_SET])
            if fused is not None:
                module.fuse_qkv(fused)
        elif isinstance(module, MLP) and module.gate_up_proj is None:
            fused, why = concat_linears([module.gate_proj, module.up_proj])
            if fused is not None:
                module.fuse_gate_up(fused)
        else:
            continue
        outcome.setdefault("fused" if fused is not None else why, []).append(name)
    return outcome
