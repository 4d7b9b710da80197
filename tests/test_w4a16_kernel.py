"""The Triton W4A16 kernel against the torch reference (``Int4Linear.forward`` on the CPU),
run by Triton's interpreter (TRITON_INTERPRET=1) in a subprocess so no GPU is needed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter: TRITON_INTERPRET must be set before triton is imported.
SCRIPT = r"""
import json, sys, torch
import torch.nn as nn
from compiler.int4 import Int4Linear
from compiler.kernels.w4a16 import w4a16_matmul
results = []
for (m, k, n, g, zp, bias, seed) in json.loads(sys.argv[1]):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    q = Int4Linear.from_float(lin, g, zp)
    x = torch.randn(2, m, k)  # fresh random inputs, with a leading batch dim
    ref = q(x)  # CPU: the torch reference path (unpack -> dequantize -> matmul)
    out = w4a16_matmul(x, q.qweight, q.scales, q.qzeros, q.in_features, q.group_size, q.bias)
    rel = float((out - ref).norm() / ref.norm())
    results.append({"case": [m, k, n, g, zp, bias], "rel": rel, "finite": bool(torch.isfinite(out).all())})
print(json.dumps(results))
"""

CASES = [
    # m, K, N, g, zero_point, bias, seed
    (5, 128, 96, 32, True, False, 0),
    (17, 256, 64, 64, True, True, 1),
    (3, 256, 80, 128, False, False, 2),
    (8, 512, 64, 256, True, False, 3),
    (9, 96, 64, 64, True, True, 4),     # K not divisible by g: padded to 128 (policy "pad")
    (4, 200, 48, 128, False, False, 5),  # padded to 256, symmetric, odd n_blocks
    (1, 576, 64, 128, True, False, 6),   # SmolLM2's hidden size under "pad"
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
