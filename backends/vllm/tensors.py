"""The artifact's quantized buffers in compressed-tensors' on-disk layout, bit for bit.

INT4 (``Int4Linear``, compiler/formats/int4.py) -> ``pack-quantized``. qcompile stores codes
q ∈ [0, 15] and zero points z ∈ [0, 15] with w = (q − z)·s (symmetric: z = 8). compressed-tensors
quantizes to int8 q' ∈ [−8, 7] with w = (q' − z')·s and stores both +8 (unsigned nibbles), so
its stored nibbles are exactly ours: q' + 8 = q and z' + 8 = z. Only the packing differs:

    weight_packed      int32 [N, K / 8]   word j of row n holds columns 8j..8j+7 at bits 0, 4, …, 28.
                                          Our qweight row is bytes of (even column low nibble, odd
                                          column high nibble), so four consecutive bytes read as one
                                          little-endian int32 are that word: a reshape and a view.
    weight_scale       model dtype [N, K / g]  our scales, unchanged
    weight_zero_point  int32 [ceil(N / 8), K / g]  asymmetric only: z packed the same way along the
                                          output dimension (rows padded with nibble 0 to a multiple of 8)
    weight_shape       int64 [2] = [N, K]
    bias               model dtype [N]    when the layer has one

FP8 (``Fp8Linear``, compiler/formats/fp8.py) -> ``float-quantized`` / ``naive-quantized``:

    weight        float8_e4m3fn [N, K]   our codes, unchanged
    weight_scale  float32 [N, 1] (channel) or [1] (tensor)  our scales (kept float32: vLLM's FP8
                                          layers hold float32 scales, and a cast to the model dtype
                                          would change them)
    input_scale   float32 [1]            static activations only
    bias          model dtype [N]

INT8 (``Int8Linear``, compiler/formats/int8.py) -> ``int-quantized`` (W8A8) / ``pack-quantized`` (W8A16):

    weight             int8 [N, K]       our codes, unchanged (W8A8)
    weight_packed      int32 [N, K / 4]  W8A16: the codes + 128 as bytes, four to a little-endian word
    weight_shape       int64 [2] = [N, K] W8A16
    weight_scale       float32 [N, 1]    our scales (W8A16: in the model dtype, as vLLM's WNA16 layers hold them)
    input_scale        float32 [1]       static activations only
    input_zero_point   int8 [1]          static asymmetric activations only
    bias               model dtype [N]

FP8 KV cache -> ``layers.i.self_attn.k_scale`` / ``v_scale`` float32 [1] (vLLM maps them onto
its attention layers).
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from compiler.errors import ArtifactError
from compiler.formats.int4 import unpack_zeros
from compiler.quant.int4 import SYMMETRIC_ZERO


def _nibbles_to_int32(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 values < 16 [R, C] (C a multiple of 8) -> int32 [R, C / 8], element 8j+i at bits 4i of word j."""
    rows, cols = nibbles.shape
    pairs = nibbles.view(rows, cols // 2, 2)
    return _bytes_to_int32((pairs[..., 0] | (pairs[..., 1] << 4)).contiguous())


def _bytes_to_int32(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] -> int32 [R, C / 4]: four bytes, little-endian, per word (compressed-tensors' order)."""
    if sys.byteorder != "little":  # a view reads native order; safetensors and CT's packing are little-endian
        raise ArtifactError("exporting INT4 for vLLM needs a little-endian host")
    return packed.contiguous().view(torch.int32)


def int4_tensors(module, fmt: dict) -> dict[str, torch.Tensor]:
    """An ``Int4Linear``'s buffers as pack-quantized tensors (``fmt``: its manifest entry)."""
    buffers = dict(module.named_buffers())
    qweight, scales = buffers["qweight"], buffers["scales"]
    n, k, g = fmt["out_features"], fmt["in_features"], fmt["group_size"]
    if k != fmt["padded_in_features"] or k % 8:
        raise ArtifactError(f"int4 layer with {k} input features padded to {fmt['padded_in_features']} has no "
                            "pack-quantized layout; use group_size_policy = \"fallback\"")
    zeros = unpack_zeros(buffers["qzeros"], k // g)  # [N, K / g] in 0..15
    out = {"weight_packed": _bytes_to_int32(qweight.reshape(n, k // 2)), "weight_scale": scales,
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if fmt["zero_point"]:
        rows = F.pad(zeros.t(), (0, -n % 8), value=0)  # [K / g, N rounded up to 8]
        out["weight_zero_point"] = _nibbles_to_int32(rows).t().contiguous()  # [ceil(N / 8), K / g]
    elif not bool((zeros == SYMMETRIC_ZERO).all()):
        raise ArtifactError(f"a symmetric int4 layer holds zero points other than {SYMMETRIC_ZERO}; "
                            "the artifact is corrupt, recompile it")
    if buffers.get("bias") is not None:
        out["bias"] = buffers["bias"]
    return out


def fp8_tensors(module, fmt: dict) -> dict[str, torch.Tensor]:
    """An ``Fp8Linear``'s buffers as float-/naive-quantized tensors (``fmt``: its manifest entry)."""
    buffers = {name: t for name, t in module.named_buffers() if t is not None}
    scale = buffers["weight_scale"].float()
    out = {"weight": buffers["weight"],
           "weight_scale": scale.reshape(-1, 1) if fmt["granularity"] == "per_channel" else scale.reshape(1)}
    if fmt["activation_scheme"] == "static":
        out["input_scale"] = buffers["input_scale"].float().reshape(1)
    if "bias" in buffers:
        out["bias"] = buffers["bias"]
    return out


def int8_tensors(module, fmt: dict) -> dict[str, torch.Tensor]:
    """An ``Int8Linear``'s buffers as int-quantized (W8A8) or pack-quantized (W8A16) tensors."""
    n, k = fmt["out_features"], fmt["in_features"]
    out = {"weight_scale": module.weight_scale.float().reshape(n, 1)}
    if fmt["activation_scheme"] == "none":
        if k % 4:
            raise ArtifactError(f"int8 layer with {k} input features has no pack-quantized layout (4 codes per int32); "
                                "keep it in float (modules_to_not_convert)")
        unsigned = (module.weight.to(torch.int16) + 128).to(torch.uint8)
        out |= {"weight_packed": _bytes_to_int32(unsigned), "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    else:
        out["weight"] = module.weight
    if module.input_scale is not None:
        out["input_scale"] = module.input_scale.float().reshape(1)
    if module.input_zero_point is not None:
        out["input_zero_point"] = module.input_zero_point.to(torch.int8).reshape(1)
    if module.bias is not None:
        out["bias"] = module.bias
    return out


def kv_scale_tensors(entry: dict) -> dict[str, torch.Tensor]:
    """A per-tensor FP8 KV-cache entry (one k and one v scale per layer) as scale tensors by module name."""
    out = {}
    for i, (k, v) in enumerate(zip(entry["k_scale"], entry["v_scale"])):
        out[f"layers.{i}.self_attn.k_scale"] = torch.tensor([float(k)], dtype=torch.float32)
        out[f"layers.{i}.self_attn.v_scale"] = torch.tensor([float(v)], dtype=torch.float32)
    return out
