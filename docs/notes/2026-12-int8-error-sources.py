"""Where INT8 W8A8's KL from float comes from on SmolLM2-135M: weights or activations, and which Linears.

A study script (docs/notes/2026-12-int8-w8a8-smoothquant.md, "Where the error comes from"), run from
the repository root. It fake-quantizes the float model's decoder Linears in place, without
SmoothQuant or GPTQ: weights INT8 per output channel (round to nearest), and/or activations INT8
per token (symmetric, or asymmetric with a zero point), one Linear kind (or one layer) at a time,
and prints the mean per-token KL from float on the validation windows of pydoc and stdlib-docs.

    python docs/notes/2026-12-int8-error-sources.py kinds      # weights vs activations, by Linear kind
    python docs/notes/2026-12-int8-error-sources.py weights    # weights alone, by kind and by 5 layers
    python docs/notes/2026-12-int8-error-sources.py layers     # asymmetric activations of down_proj, layer by layer
    python docs/notes/2026-12-int8-error-sources.py rotation   # weights and activations, after the rotate pass's rotation
"""
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.fp8_quality import held_out_sets  # noqa: E402
from compiler.io.load import load_checkpoint  # noqa: E402
from compiler.quant.int8 import dequantize_weight, quantize_per_token, quantize_weight, weight_scale  # noqa: E402
from passes.distill.evaluate import compare_on_windows  # noqa: E402
from passes.rotate import rotate_residual, rotation_matrix  # noqa: E402

KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WINDOWS = int(os.environ.get("WINDOWS", 4))  # per corpus; the layer-by-layer run used 2

torch.set_num_threads(int(os.environ.get("THREADS", 1)))
source = load_checkpoint("smollm2")
model = source.model.float().eval()
sets = held_out_sets(source, ["pydoc", "stdlib-docs"], "validation", WINDOWS)
linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.split(".")[-1] in KINDS}
float_weights = {n: m.weight.data.clone() for n, m in linears.items()}


def fake_quant_forward(self, x):
    if self.quantize_input:
        rows = x.reshape(-1, x.shape[-1])
        codes, scale, zero_point = quantize_per_token(rows, self.symmetric_input)
        x = ((codes.float() - (0 if zero_point is None else zero_point.float())) * scale).reshape(x.shape).to(x.dtype)
    return F.linear(x, self.weight, self.bias)


def setup(weight_kinds, input_kinds, symmetric=True, layers=None):
    for name, m in linears.items():
        kind, layer = name.split(".")[-1], int(name.split(".")[1])
        chosen = layers is None or layer in layers
        w = float_weights[name]
        if chosen and kind in weight_kinds:
            s = weight_scale(w)
            w = dequantize_weight(quantize_weight(w, s), s)
        m.weight.data = w
        m.quantize_input, m.symmetric_input = chosen and kind in input_kinds, symmetric
        m.forward = fake_quant_forward.__get__(m)


def run(label, *args, **kwargs):
    setup(*args, **kwargs)
    kl = [compare_on_windows(model, model, w, reference=ref)["kl"] for w, ref in sets.values()]
    print(f"{label:45s} KL pydoc {kl[0]:.5f}  stdlib-docs {kl[1]:.5f}", flush=True)


ALL = set(KINDS)
what = sys.argv[1] if len(sys.argv) > 1 else "kinds"
if what == "kinds":
    run("weights (RTN per channel)", ALL, set())
    run("activations per token, symmetric", set(), ALL)
    run("activations per token, asymmetric", set(), ALL, symmetric=False)
    for kind in KINDS:
        run(f"activations per token, symmetric: {kind}", set(), {kind})
elif what == "weights":
    for kind in KINDS:
        run(f"weights: {kind}", {kind}, set())
    for first in range(0, model.config.n_layers, 5):
        run(f"weights: layers {first}-{first + 4}", ALL, set(), layers=range(first, first + 5))
elif what == "layers":
    for i in range(model.config.n_layers):
        run(f"asymmetric activations: layer {i} down_proj", set(), {"down_proj"}, symmetric=False, layers=[i])
elif what == "rotation":  # the rotate pass's default rotation, then the same fake quantization
    run("weights and activations, symmetric", ALL, ALL)
    run("weights and activations, asymmetric", ALL, ALL, symmetric=False)
    setup(set(), set())  # the float weights back before rotating them
    rotate_residual(model, rotation_matrix(model.config.dim, "hadamard", 0))
    float_weights = {n: m.weight.data.clone() for n, m in linears.items()}
    run("rotated: weights and activations, symmetric", ALL, ALL)
    run("rotated: weights and activations, asymmetric", ALL, ALL, symmetric=False)
else:
    raise SystemExit(f"unknown study {what!r}: kinds, weights, layers or rotation")
