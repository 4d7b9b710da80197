"""llama.cpp's block quantization types as grids the passes quantize onto, and their GGUF bytes.

Every type here stores, per sub-block of ``sub`` weights of a row, a scale and an offset that
llama.cpp derives from its stored fields, and unsigned codes ``q`` in [0, qmax]:

    w = q * scale + offset                       (float32; each product exact, one rounding)

    type  sub  super  codes   stored per super-block             scale            offset
    q4_0   32     32   0..15   d (f16)                            d                -8 d
    q4_1   32     32   0..15   d, m (f16)                         d                m
    q5_0   32     32   0..31   d (f16)                            d                -16 d
    q8_0   32     32   0..255  d (f16)                            d                -128 d
    q4_k   32    256   0..15   d, dmin (f16); 6-bit sc, mn / sub  d * sc           -(dmin * mn)
    q6_k   16    256   0..63   d (f16); int8 sc / sub             d * sc           -32 d sc

which is llama.cpp's dequantization (``dequantize_row_*`` in ggml-quants.c, and the ``gguf``
package's numpy port) term for term: the file a pass's codes are written to dequantizes to
exactly the weights the pass chose. ``choose`` picks the stored fields from a weight and a clip
ratio per sub-block (the awq pass's clip search); ``quantize`` rounds to the nearest code for
given fields (GPTQ rounds column by column on the same ``scale``/``offset``); ``pack`` writes
llama.cpp's block bytes. Rows are zero-padded by callers to a multiple of ``super``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

F16_MAX = float(torch.finfo(torch.float16).max)


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-F16_MAX, F16_MAX).to(torch.float16)


def _signed_absmax(groups: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude of each group, with its sign (llama.cpp's ``max``)."""
    return groups.gather(-1, groups.abs().argmax(-1, keepdim=True))[..., 0]


def _safe_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(b == 0, torch.zeros_like(a), a / torch.where(b == 0, torch.ones_like(b), b))


@dataclass(frozen=True)
class BlockType:
    """One llama.cpp block type (the table in the module docstring)."""

    name: str  # "q4_k": the awq pass's ``format = "gguf:q4_k"``
    ggml: str  # "Q4_K": gguf.GGMLQuantizationType's name
    sub: int  # weights per scale
    super: int  # weights per stored block
    qmax: int

    @property
    def bits(self) -> float:
        """Bits per weight in the file."""
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.ggml]]
        return 8 * size / block

    # -- fields ------------------------------------------------------------------------------
    def choose(self, w: torch.Tensor, clip: torch.Tensor | float = 1.0) -> dict[str, torch.Tensor]:
        """Stored fields for ``w`` [N, K] (K a multiple of ``super``), its sub-block ranges shrunk by
        ``clip`` (scalar or [N, K / sub])."""
        n, k = w.shape
        groups = w.float().view(n, k // self.sub, self.sub)
        if isinstance(clip, torch.Tensor):
            clip = clip.float()
        return _CHOOSE[self.name](self, groups, clip)

    def scale_offset(self, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 scale and offset per sub-block [N, K / sub], as llama.cpp derives them."""
        return _SCALE_OFFSET[self.name](self, fields)

    # -- codes -------------------------------------------------------------------------------
    def quantize(self, w: torch.Tensor, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        """Nearest codes uint8 [N, K] of ``w`` on the grid of ``fields``."""
        scale, offset = self.scale_offset(fields)
        n, k = w.shape
        groups = w.float().view(n, k // self.sub, self.sub)
        q = _safe_div(groups - offset[..., None], scale[..., None].expand_as(groups)).round()
        return q.clamp(0, self.qmax).to(torch.uint8).view(n, k)

    def dequantize(self, codes: torch.Tensor, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        """float32 weights [N, K]: ``codes * scale + offset``."""
        scale, offset = self.scale_offset(fields)
        n, k = codes.shape
        groups = codes.view(n, k // self.sub, self.sub).float()
        return (groups * scale[..., None] + offset[..., None]).view(n, k)

    def fake_quantize(self, w: torch.Tensor, clip: torch.Tensor | float = 1.0) -> torch.Tensor:
        fields = self.choose(w, clip)
        return self.dequantize(self.quantize(w, fields), fields)

    # -- bytes -------------------------------------------------------------------------------
    def pack(self, codes: torch.Tensor, fields: dict[str, torch.Tensor]) -> np.ndarray:
        """llama.cpp's blocks of ``codes`` [N, K]: uint8 [N, K / super * block bytes]."""
        n, k = codes.shape
        blocks = _PACK[self.name](self, codes.numpy().reshape(n * k // self.super, self.super),
                                  {key: v.numpy().reshape(n * k // self.super, -1) for key, v in fields.items()})
        return np.ascontiguousarray(blocks).reshape(n, -1)


# ---- choose: the stored fields -------------------------------------------------------------
def _choose_symmetric(t: BlockType, groups: torch.Tensor, clip) -> dict:
    """q4_0 / q5_0: d = max / -(zero) with max the signed extreme (all 2^b levels used); q8_0: |max| / 127."""
    if t.name == "q8_0":
        return {"d": _f16(groups.abs().amax(-1) * clip / 127)}
    zero = (t.qmax + 1) // 2
    return {"d": _f16(_signed_absmax(groups) * clip / -zero)}


def _choose_q4_1(t: BlockType, groups: torch.Tensor, clip) -> dict:
    """d = (max - min) / 15, m = min, the range shrunk about its middle by ``clip``."""
    lo, hi = groups.amin(-1), groups.amax(-1)
    mid, half = (hi + lo) / 2, (hi - lo) / 2 * clip
    return {"d": _f16(2 * half / t.qmax), "m": _f16(mid - half)}


def _choose_q4_k(t: BlockType, groups: torch.Tensor, clip) -> dict:
    """Per 32-weight sub-block a scale (max - min) / 15 and a min <= 0 (the range through 0, as the
    INT4 zero-point grid), both as 6-bit codes of the super-block's f16 d and dmin."""
    n, nb, _ = groups.shape
    hi = groups.amax(-1).clamp(min=0) * clip
    lo = groups.amin(-1).clamp(max=0) * clip
    scale, mins = ((hi - lo) / t.qmax).view(n, -1, 8), (-lo).view(n, -1, 8)  # [N, supers, 8]
    d, dmin = _f16(scale.amax(-1) / 63), _f16(mins.amax(-1) / 63)
    sc = _safe_div(scale, d.float()[..., None]).round().clamp(0, 63)
    mn = _safe_div(mins, dmin.float()[..., None]).round().clamp(0, 63)
    return {"d": d, "dmin": dmin, "sc": sc.to(torch.uint8).view(n, nb), "mn": mn.to(torch.uint8).view(n, nb)}


def _choose_q6_k(t: BlockType, groups: torch.Tensor, clip) -> dict:
    """Per 16-weight sub-block a signed scale max / -32 as an int8 code of the super-block's f16 d."""
    n, nb, _ = groups.shape
    scale = (_signed_absmax(groups) * clip / -32).view(n, -1, 16)
    d = _f16(scale.abs().amax(-1) / 127)
    sc = _safe_div(scale, d.float()[..., None]).round().clamp(-128, 127)
    return {"d": d, "sc": sc.to(torch.int8).view(n, nb)}


_CHOOSE = {"q4_0": _choose_symmetric, "q5_0": _choose_symmetric, "q8_0": _choose_symmetric,
           "q4_1": _choose_q4_1, "q4_k": _choose_q4_k, "q6_k": _choose_q6_k}


# ---- scale and offset per sub-block --------------------------------------------------------
def _per_sub(t: BlockType, super_field: torch.Tensor) -> torch.Tensor:
    """A per-super-block field [N, supers] repeated over its sub-blocks [N, supers * super / sub]."""
    return super_field.float().repeat_interleave(t.super // t.sub, dim=-1)


def _scale_offset_symmetric(t: BlockType, f: dict):
    d = f["d"].float()
    return d, -((t.qmax + 1) // 2) * d


def _scale_offset_q4_1(t: BlockType, f: dict):
    return f["d"].float(), f["m"].float()


def _scale_offset_q4_k(t: BlockType, f: dict):
    return _per_sub(t, f["d"]) * f["sc"].float(), -(_per_sub(t, f["dmin"]) * f["mn"].float())


def _scale_offset_q6_k(t: BlockType, f: dict):
    scale = _per_sub(t, f["d"]) * f["sc"].float()
    return scale, -32 * scale


_SCALE_OFFSET = {"q4_0": _scale_offset_symmetric, "q5_0": _scale_offset_symmetric, "q8_0": _scale_offset_symmetric,
                 "q4_1": _scale_offset_q4_1, "q4_k": _scale_offset_q4_k, "q6_k": _scale_offset_q6_k}


# ---- pack: llama.cpp's block layouts (ggml-common.h) ---------------------------------------
def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[B, 32] codes -> [B, 16] bytes: element i in the low nibble, element i + 16 in the high one."""
    return (q[:, :16] & 0x0F) | (q[:, 16:] << 4)


def _pack_q4_0(t, q, f):
    return np.concatenate([_f16_bytes(f["d"]), _nibbles(q)], axis=1)


def _pack_q4_1(t, q, f):
    return np.concatenate([_f16_bytes(f["d"]), _f16_bytes(f["m"]), _nibbles(q)], axis=1)


def _pack_q5_0(t, q, f):
    high = np.packbits((q >> 4) & 1, axis=-1, bitorder="little")  # qh: bit i = bit 4 of element i
    return np.concatenate([_f16_bytes(f["d"]), high, _nibbles(q & 0x0F)], axis=1)


def _pack_q8_0(t, q, f):
    return np.concatenate([_f16_bytes(f["d"]), (q.astype(np.int16) - 128).astype(np.int8).view(np.uint8)], axis=1)


def _pack_q4_k(t, q, f):
    """d, dmin, 12 bytes of 6-bit sc/mn (get_scale_min_k4), then 4 chunks of 32 bytes: sub-block
    2j in the low nibbles, 2j + 1 in the high ones."""
    b = q.shape[0]
    sc, mn = f["sc"].astype(np.uint8), f["mn"].astype(np.uint8)  # [B, 8]
    scales = np.empty((b, 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    subs = q.reshape(b, 4, 2, 32)
    qs = (subs[:, :, 0] | (subs[:, :, 1] << 4)).reshape(b, 128)
    return np.concatenate([_f16_bytes(f["d"]), _f16_bytes(f["dmin"]), scales, qs], axis=1)


def _pack_q6_k(t, q, f):
    """ql (low 4 bits: per 128-weight half, weights l and l + 64 share a byte), qh (high 2 bits:
    weights l, l + 32, l + 64, l + 96 of a half share a byte), int8 scales, d."""
    b = q.shape[0]
    halves = q.reshape(b, 2, 4, 32)  # [B, half, quarter, 32]
    low, high = halves & 0x0F, halves >> 4
    ql = low[:, :, 0:2].reshape(b, 2, 64) | (low[:, :, 2:4].reshape(b, 2, 64) << 4)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql.reshape(b, 128), qh.reshape(b, 64), f["sc"].view(np.uint8), _f16_bytes(f["d"])], axis=1)


_PACK = {"q4_0": _pack_q4_0, "q4_1": _pack_q4_1, "q5_0": _pack_q5_0, "q8_0": _pack_q8_0,
         "q4_k": _pack_q4_k, "q6_k": _pack_q6_k}

BLOCK_TYPES: dict[str, BlockType] = {t.name: t for t in (
    BlockType("q4_0", "Q4_0", 32, 32, 15), BlockType("q4_1", "Q4_1", 32, 32, 15),
    BlockType("q5_0", "Q5_0", 32, 32, 31), BlockType("q8_0", "Q8_0", 32, 32, 255),
    BlockType("q4_k", "Q4_K", 32, 256, 15), BlockType("q6_k", "Q6_K", 16, 256, 63))}
# llama.cpp's fallback for a row a K-quant's 256-weight super-block does not divide (llama-quant.cpp).
FALLBACK = {"q4_k": "q5_0", "q6_k": "q8_0"}
