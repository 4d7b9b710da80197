"""benchmarks/cpu_layers_bandwidth.py: the bytes a decode step is credited with per format, the GGUF
it writes for llama.cpp (read back by qcompile's own GGUF reader: the same weights, Q4_0 from the
INT4 codes), and a table that keeps every row."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from compiler.io.gguf import read_gguf

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(dim=64, intermediate_size=128, n_layers=2, n_heads=4, n_kv_heads=2)
# (in, out) of each projection of a TINY layer: q, k, v, o, gate, up, down
PROJECTIONS = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("cpu_layers_bandwidth", ROOT / "benchmarks" / "cpu_layers_bandwidth.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    module.MODELS["tiny"] = TINY
    return module


def tiny(bench, fmt: str):
    return bench.quantize(bench.random_model(bench.model_config("tiny", 16)), bench.FORMATS[fmt])


@pytest.mark.parametrize("fmt, per_projection", [
    ("float32", lambda k, n: 4 * n * k),
    ("int4-g32", lambda k, n: n * k // 2 + 4 * n * (k // 32) + n * -(-(k // 32) // 2)),  # codes, float32 scales, zero nibbles
    ("int4-g128", lambda k, n: n * 128 // 2 + 4 * n + n),  # one group per row, K zero-padded to it
    ("fp8", lambda k, n: n * k + 4 * n),  # codes and per-row scales
])
def test_weight_bytes_are_the_stored_format(bench, fmt, per_projection):
    norms = 2 * 4 * TINY["dim"]
    expected = TINY["n_layers"] * (sum(per_projection(k, n) for k, n in PROJECTIONS) + norms)
    assert bench.stored_bytes(tiny(bench, fmt).layers) == expected


def test_q4_0_gguf_holds_the_int4_weights(bench, tmp_path):
    model = tiny(bench, "int4-g32")
    layer_bytes = bench.write_gguf(model, tmp_path / "q4_0.gguf")
    config, tensors = read_gguf(tmp_path / "q4_0.gguf", torch.float32)
    assert (config.dim, config.n_layers, config.n_kv_heads, config.vocab_size) == (64, 2, 2, 16)
    for name, module in model.named_modules():
        if isinstance(module, bench.Int4Linear):  # q/k rows permuted and back, nibbles reordered: the same values
            assert torch.equal(tensors[f"{name}.weight"], module.dequantized_weight()), name
    weights = sum(k * n for k, n in PROJECTIONS)
    assert layer_bytes == TINY["n_layers"] * (weights // 32 * 18 + 2 * 4 * TINY["dim"])


def test_f32_gguf_holds_the_float_weights(bench, tmp_path):
    model = tiny(bench, "float32")
    bench.write_gguf(model, tmp_path / "f32.gguf")
    _, tensors = read_gguf(tmp_path / "f32.gguf", torch.float32)
    for name, value in model.state_dict().items():
        assert torch.equal(tensors[name], value), name


def test_the_table_keeps_rows_without_a_figure(bench, capsys):
    meta = {"cpu": "a CPU", "threads": 2, "clock": "wall", "torch": "2", "torch_cpu_capability": "AVX512", "bandwidth_gb_s": 40.0,
            "bandwidth_probes": [40.0, 30.0], "bandwidth_gib": 1.0, "context": 128, "vocab": 256, "load_average_start": 0.5, "load_average_end": 1.0}
    rows = [{"model": "m", "format": "int4", "kernel": "k", "weight_bytes": int(1e9),
             "rows_1": bench.figures(int(1e9), 50.0), "rows_16": bench.figures(int(1e9), 50.0)},
            {"model": "m", "format": "llama.cpp Q4_0", "kernel": "llama.cpp", "weight_bytes": int(1e9),
             "rows_1": bench.figures(int(1e9), 50.0)}]
    bench.add_shares(rows, 40.0)
    assert rows[1]["rows_1"] == {"ms": 50.0, "gb_s": 20.0, "share_of_bandwidth": 0.5}
    bench.print_table(rows, meta, [1, 16])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == "| m | int4 | k | 1000.0 | 50.00 | 20.0 | 50% | 50.00 | 20.0 | 50% |"
    assert lines[-1] == "| m | llama.cpp Q4_0 | llama.cpp | 1000.0 | 50.00 | 20.0 | 50% | — | — | — |"
