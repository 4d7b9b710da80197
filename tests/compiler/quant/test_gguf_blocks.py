"""llama.cpp's block types as qcompile writes them: the bytes ``pack`` writes dequantize, by the
``gguf`` package's own numpy port of llama.cpp, to exactly ``dequantize``'s weights."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from compiler.quant.gguf_blocks import BLOCK_TYPES


def weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[0, 5] = 1.5  # an outlier: its block's range, and the super-block's largest scale
    w[1] = 0.0  # an all-zero row: zero scales, no division by them
    w[2, :64] = torch.linspace(-0.3, 0.01, 64)  # one-sided blocks
    return w


@pytest.mark.parametrize("name", sorted(BLOCK_TYPES))
def test_packed_bytes_dequantize_to_exactly_our_weights(name):
    t = BLOCK_TYPES[name]
    w = weights(6, 512, seed=len(name))
    clip = torch.rand(6, 512 // t.sub, generator=torch.Generator().manual_seed(1)) * 0.4 + 0.6
    fields = t.choose(w, clip)
    codes = t.quantize(w, fields)
    ours = t.dequantize(codes, fields)
    blocks = t.pack(codes, fields)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.ggml]]
    assert blocks.shape == (6, 512 // block * size) and blocks.dtype == np.uint8
    theirs = gguf_dequantize(blocks, gguf.GGMLQuantizationType[t.ggml])
    assert np.array_equal(theirs, ours.numpy()), f"{name}: max diff {np.abs(theirs - ours.numpy()).max()}"
    assert int(codes.max()) <= t.qmax and not torch.isnan(ours).any()


@pytest.mark.parametrize("name", sorted(BLOCK_TYPES))
def test_codes_are_the_nearest_on_the_grid(name):
    """Unclipped, a one-scale block's grid spans it: every weight within half a step of its value
    (a step for Q4_0/Q5_0, whose levels -8..7 stop a step short of the extreme opposite the largest).
    A K-quant's sub-block scale is a 6-/8-bit code of the super-block's, so its grid may stop short of
    a small sub-block's edge (as llama.cpp's): only the whole error is bounded there."""
    t = BLOCK_TYPES[name]
    w = weights(4, 256, seed=3)
    fields = t.choose(w)
    scale, _ = t.scale_offset(fields)
    error = (t.dequantize(t.quantize(w, fields), fields) - w).view(4, -1, t.sub).abs()
    if t.super == t.sub:
        steps = 0.5 if name in ("q4_1", "q8_0") else 1.0
        assert bool((error <= scale.abs()[..., None] * steps * 1.001 + 1e-7).all())
    rel = float((t.fake_quantize(w) - w).norm() / w.norm())
    assert rel < {"q8_0": 0.01, "q6_k": 0.03}.get(name, 0.12), rel


def test_k_quant_scale_codes_use_their_full_range():
    """Q4_K's sub-block scales are 6-bit codes of the super-block's d: the largest gets code 63 (or 62 after f16 rounding)."""
    t = BLOCK_TYPES["q4_k"]
    fields = t.choose(weights(4, 512, seed=5))
    nonzero_rows = fields["sc"].view(4, -1, 8)[[0, 2, 3]]  # row 1 is all zeros
    assert int(nonzero_rows.amax(-1).min()) >= 62
    assert int(fields["sc"].max()) <= 63 and int(fields["mn"].max()) <= 63
