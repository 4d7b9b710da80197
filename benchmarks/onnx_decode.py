"""Decode latency per token at batch 1 on this CPU: INT4 MatMulNBits vs float ONNX vs torch.

    python benchmarks/onnx_decode.py [--tokens 32] [--repeats 3] [--threads N] [--json]

All three run in one process on the same prompt, interleaved per repeat (best repeat kept), so
the ratios are measured under the same machine load. The torch baseline is the plain model with
the contiguous KV cache. INT4 is RTN (``Int4Linear.from_float``, group 64, every linear layer but
the tied lm_head). The memory-bandwidth floor is the weight bytes each decode step must read
divided by the bandwidth of a large ``numpy.copyto`` (bytes read + written per second).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.onnx.export import OnnxExportOptions, export_onnx  # noqa: E402
from backends.onnx.runner import OnnxRunner  # noqa: E402
from compiler.formats.int4 import Int4Linear  # noqa: E402
from compiler.formats.qlinear import linear_modules  # noqa: E402
from compiler.io.load import load_checkpoint  # noqa: E402
from compiler.model.kv_cache import ContiguousKVCache  # noqa: E402

PROMPT_LEN = 32
GROUP = 64


def measure_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a large copy, counting the read and the write."""
    src = np.ones(mib * 2**20 // 8, np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of every matmul weight a decode step reads (the embedding lookup reads one row)."""
    total = 0
    for m in model.modules():
        if isinstance(m, Int4Linear):
            total += sum(t.numel() * t.element_size() for t in (m.qweight, m.scales, m.qzeros))
        elif isinstance(m, torch.nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total


def torch_decode(model, prompt: torch.Tensor, tokens: int) -> float:
    c = model.config
    cache = ContiguousKVCache(c.n_layers, 1, PROMPT_LEN + tokens + 1, c.n_kv_heads, c.head_dim)
    with torch.no_grad():
        logits = model(prompt, torch.arange(PROMPT_LEN)[None], cache)
        start = time.perf_counter()
        for t in range(tokens):
            next_id = logits[:, -1].argmax(-1, keepdim=True)
            logits = model(next_id, torch.tensor([[PROMPT_LEN + t]]), cache)
        return (time.perf_counter() - start) / tokens


def onnx_decode(runner: OnnxRunner, prompt: np.ndarray, tokens: int) -> float:
    logits = runner.prefill(prompt)
    start = time.perf_counter()
    for _ in range(tokens):
        logits = runner.decode(logits[:, -1].argmax(-1)[:, None].astype(np.int64))
    return (time.perf_counter() - start) / tokens


def int4_copy(model):
    q = copy.deepcopy(model)
    for name, linear in linear_modules(q).items():
        if name != "lm_head":
            q.set_submodule(name, Int4Linear.from_float(linear, GROUP))
    return q


def run(tokens: int, repeats: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    loaded = load_checkpoint("smollm2")
    models = {"torch float32": loaded.model, "ONNX float32": loaded.model, "ONNX INT4 MatMulNBits g64": int4_copy(loaded.model)}
    prompt = torch.randint(0, loaded.model.config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        runners = {}
        for label in ("ONNX float32", "ONNX INT4 MatMulNBits g64"):
            variant = copy.copy(loaded)
            variant.model = models[label]
            out = Path(tmp) / label.split()[1]
            export_onnx(variant, out, OnnxExportOptions(max_len=PROMPT_LEN + tokens + 1))
            runners[label] = OnnxRunner(out, threads=threads)
        best = {label: float("inf") for label in models}
        for _ in range(repeats):  # interleaved, so load changes hit every runtime alike
            best["torch float32"] = min(best["torch float32"], torch_decode(loaded.model, prompt, tokens))
            for label, runner in runners.items():
                best[label] = min(best[label], onnx_decode(runner, prompt.numpy(), tokens))
    bandwidth = measure_bandwidth()
    rows = []
    for label, seconds in best.items():
        floor = weight_bytes_per_token(models[label]) / bandwidth
        rows.append({"runtime": label, "ms_per_token": 1e3 * seconds, "speedup_vs_torch": best["torch float32"] / seconds,
                     "weight_mib_per_token": weight_bytes_per_token(models[label]) / 2**20,
                     "floor_ms": 1e3 * floor, "fraction_of_floor": floor / seconds})
    return {"tokens": tokens, "repeats": repeats, "threads": threads, "bandwidth_gb_s": bandwidth / 1e9, "rows": rows}


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"SmolLM2-135M decode, batch 1, {result['threads']} threads, best of {result['repeats']} × "
                        f"{result['tokens']} tokens; copy bandwidth {result['bandwidth_gb_s']:.1f} GB/s")
    for col in ("runtime", "ms/token", "× torch", "weights MiB/token", "floor ms", "floor / measured"):
        table.add_column(col, justify="left" if col == "runtime" else "right")
    for r in result["rows"]:
        table.add_row(r["runtime"], f"{r['ms_per_token']:.2f}", f"{r['speedup_vs_torch']:.2f}", f"{r['weight_mib_per_token']:.1f}",
                      f"{r['floor_ms']:.2f}", f"{100 * r['fraction_of_floor']:.0f}%")
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.tokens, args.repeats, args.threads)
    print(json.dumps(result, indent=1)) if args.json else print_table(result)


if __name__ == "__main__":
    main()
