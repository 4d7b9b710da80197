"""The Triton W4A16 kernel against the torch reference (``Int4Linear.reference_forward``),
run by Triton's interpreter (TRITON_INTERPRET=1) in a subprocess so no GPU is needed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]

# Runs in a fresh interpreter: TRITON_INTERPRET must be set before triton is imported.
SCRIPT = r"""
import json, sys, torch
import torch.nn as nn
from compiler.formats.int4 import Int4Linear
from compiler.kernels.w4a16 import w4a16_matmul
results = []
for (m, k, n, g, zp, bias, seed, config) in json.loads(sys.argv[1]):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    q = Int4Linear.from_float(lin, g, zp)
    x = torch.randn(2, m, k)  # fresh random inputs, with a leading batch dim
    ref = q.reference_forward(x)  # unpack -> dequantize -> matmul
    out = w4a16_matmul(x, q.qweight, q.scales, q.qzeros, q.in_features, q.group_size, q.bias, config)
    rel = float((out - ref).norm() / ref.norm())
    results.append({"case": [m, k, n, g, zp, bias, config], "rel": rel, "finite": bool(torch.isfinite(out).all())})
print(json.dumps(results))
"""

SPLIT_K = {"block_m": 16, "block_n": 32, "block_k": 32, "split_k": 3, "num_warps": 4, "num_stages": 2}
WIDE = {"block_m": 32, "block_n": 64, "block_k": 128, "split_k": 1, "num_warps": 4, "num_stages": 2}
CASES = [
    # m, K, N, g, zero_point, bias, seed, config (None: default_config)
    (5, 128, 96, 32, True, False, 0, None),
    (17, 256, 64, 64, True, True, 1, None),
    (3, 256, 80, 128, False, False, 2, None),
    (8, 512, 64, 256, True, False, 3, None),
    (9, 96, 64, 64, True, True, 4, None),     # K not divisible by g: padded to 128 (policy "pad")
    (4, 200, 48, 128, False, False, 5, None),  # padded to 256, symmetric, odd n_blocks
    (1, 576, 64, 128, True, False, 6, None),   # SmolLM2's hidden size under "pad"
    (2, 576, 40, 64, True, True, 7, SPLIT_K),  # K split over 3 programs (atomic float32 sums), bias after
    (1, 200, 64, 128, True, False, 8, SPLIT_K),  # more splits than some tiles have K blocks
    (33, 384, 70, 128, True, True, 9, WIDE),   # block_k = g, N not a multiple of block_n
]


def test_w4a16_kernel_matches_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(CASES)
    for r in results:
        print(f"W4A16 kernel {r['case']}: relative error {r['rel']:.2e}")
        assert r["finite"], r
        assert r["rel"] < 1e-5, r  # NaN fails this comparison too


def test_w4a16_block_k_must_divide_the_group():
    import torch

    from compiler.formats.int4 import Int4Linear
    from compiler.kernels.w4a16 import w4a16_matmul

    q = Int4Linear.from_float(torch.nn.Linear(128, 32), 64)
    with pytest.raises(ValueError, match="must divide the group size 64"):
        w4a16_matmul(torch.randn(2, 128), q.qweight, q.scales, q.qzeros, 128, 64, None, {**WIDE, "block_k": 128})


@pytest.mark.parametrize("k, n, g, zero_point", [(576, 40, 128, True), (200, 33, 64, False), (256, 64, 256, True)])
def test_w4_dequantize_matches_reference(k, n, g, zero_point):
    """The large-M path's dequantize kernel gives Int4Linear.dequantized_weight's values: exactly in
    float32; in bfloat16 within one step, as Triton's interpreter rounds float32 to bfloat16 in numpy,
    not to nearest-even as GPUs do (benchmarks/gpu_kernels.py checks bfloat16 bitwise on a GPU)."""
    import torch

    from compiler.formats.int4 import Int4Linear
    from compiler.kernels.w4a16 import w4_dequantize

    torch.manual_seed(k + n)
    q = Int4Linear.from_float(torch.nn.Linear(k, n), g, zero_point)
    for dtype in (torch.float32, torch.bfloat16):
        q.scales = q.scales.to(dtype)  # as in a model of that dtype
        w = w4_dequantize(q.qweight, q.scales, q.qzeros, k, g, dtype)
        ref = q.dequantized_weight()
        assert w.shape == (n, k) and w.dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(w, ref)
        else:
            assert ((w.float() - ref.float()).abs() <= ref.float().abs() * 2**-7).all()
