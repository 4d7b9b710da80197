"""Decode latency per token at batch 1 on this CPU: INT4 MatMulNBits vs float ONNX vs torch.

    python benchmarks/onnx_decode.py [--model smollm2] [--tokens 32] [--repeats 3] [--threads N] [--accuracy-levels 0,4]
        [--attention gqa,standard,gqa-rotary-op] [--max-len L] [--json FILE]

All run in one process on the same prompt, interleaved per repeat (each figure the median of the
repeats, ``benchmarks/common.py``), so the
ratios are measured under the same machine load; "CPU ms/token" is the process's CPU time per
token, which other processes' load barely moves (at ``--threads 1``; with more it also counts the
threads' spinning). The torch baselines are the plain model and its
INT4 copy (torch's INT4 CPU kernel) with the contiguous KV cache. INT4 is RTN
(``Int4Linear.from_float``, group 64, every linear layer but the tied lm_head), exported once per
MatMulNBits ``accuracy_level``; every ONNX bundle once per ``--attention``: ``gqa`` (the default
lowering: GroupQueryAttention, the rotary embedding inside it), ``gqa-rotary-op`` (GroupQueryAttention
after com.microsoft RotaryEmbedding nodes) and ``standard`` (``--no-fused-attention``: standard-op
attention over every cache slot). ``--max-len`` is the bundles' cache length (default: the prompt
and the decoded tokens; a serving bundle's default is 1024, and the standard attention reads every
slot of it). "rel. error" is each ONNX bundle's prefill logits against its
torch model run on the dequantize reference (max |diff| / max |ref|). The memory-bandwidth floor
is the weight bytes each decode step must read divided by the bandwidth of a large
``numpy.copyto`` (bytes read + written per second).
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.onnx.export import OnnxExportOptions, export_onnx  # noqa: E402
from benchmarks.common import Timing, write_result  # noqa: E402
from backends.onnx.runner import OnnxRunner  # noqa: E402
from compiler.formats.int4 import Int4Linear  # noqa: E402
from compiler.formats.qlinear import linear_modules  # noqa: E402
from compiler.io.load import load_checkpoint  # noqa: E402
from compiler.kernels.int4_cpu import reference_only  # noqa: E402
from compiler.model.kv_cache import ContiguousKVCache  # noqa: E402

PROMPT_LEN = 32
GROUP = 64
# --attention -> (label suffix, export options)
ATTENTION = {"gqa": ("GroupQueryAttention", {}),
             "gqa-rotary-op": ("GroupQueryAttention after RotaryEmbedding", {"rotary_in_attention": False}),
             "standard": ("standard attention", {"fused_attention": False})}


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


def per_token(start: tuple[float, float], tokens: int) -> dict[str, float]:
    """Wall and CPU seconds per token since ``start`` = (perf_counter, process_time). The process's CPU
    time barely moves with other processes' load: at one thread it is the figure to compare on a
    shared machine (at more it also counts the threads' spinning)."""
    return {"wall": (time.perf_counter() - start[0]) / tokens, "process": (time.process_time() - start[1]) / tokens}


def torch_decode(model, prompt: torch.Tensor, tokens: int) -> dict[str, float]:
    c = model.config
    cache = ContiguousKVCache(c.n_layers, 1, PROMPT_LEN + tokens + 1, c.n_kv_heads, c.head_dim)
    with torch.no_grad():
        logits = model(prompt, torch.arange(PROMPT_LEN)[None], cache)
        start = time.perf_counter(), time.process_time()
        for t in range(tokens):
            next_id = logits[:, -1].argmax(-1, keepdim=True)
            logits = model(next_id, torch.tensor([[PROMPT_LEN + t]]), cache)
        return per_token(start, tokens)


def onnx_decode(runner: OnnxRunner, prompt: np.ndarray, tokens: int) -> dict[str, float]:
    logits = runner.prefill(prompt)
    start = time.perf_counter(), time.process_time()
    for _ in range(tokens):
        logits = runner.decode(logits[:, -1].argmax(-1)[:, None].astype(np.int64))
    return per_token(start, tokens)


def int4_copy(model):
    q = copy.deepcopy(model)
    for name, linear in linear_modules(q).items():
        if name != "lm_head":
            q.set_submodule(name, Int4Linear.from_float(linear, GROUP))
    return q


def prefill_rel_error(runner: OnnxRunner, model, prompt: torch.Tensor) -> float:
    with torch.no_grad(), reference_only():
        ref = model(prompt).numpy()
    got = runner.prefill(prompt.numpy())
    return float(np.abs(got - ref).max() / np.abs(ref).max()) if np.isfinite(got).all() else float("inf")


def run(tokens: int, repeats: int, threads: int, accuracy_levels: list[int], attention: list[str],
        max_len: int | None = None, model: str = "smollm2") -> dict:
    torch.set_num_threads(threads)
    loaded = load_checkpoint(model)
    int4 = int4_copy(loaded.model)
    max_len = max_len or PROMPT_LEN + tokens + 1
    torch_models = {"torch float32": loaded.model, "torch INT4 g64": int4}
    onnx_models = {}
    for kind in attention:
        suffix, options = ATTENTION[kind]
        onnx_models[f"ONNX float32, {suffix}"] = (loaded.model, 0, options)
        onnx_models.update({f"ONNX INT4 MatMulNBits g64 accuracy_level={level}, {suffix}": (int4, level, options)
                            for level in accuracy_levels})
    models = {**torch_models, **{label: model for label, (model, _, _) in onnx_models.items()}}
    prompt = torch.randint(0, loaded.model.config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    rel_errors = {}
    with tempfile.TemporaryDirectory() as tmp:
        runners = {}
        for i, (label, (model, level, options)) in enumerate(onnx_models.items()):
            variant = copy.copy(loaded)
            variant.model = model
            out = Path(tmp) / str(i)
            export_onnx(variant, out, OnnxExportOptions(max_len=max_len, accuracy_level=level, **options))
            runners[label] = OnnxRunner(out, threads=threads)
            rel_errors[label] = prefill_rel_error(runners[label], model, prompt)
        timings = {label: Timing() for label in models}
        for _ in range(repeats):  # interleaved, so load changes hit every runtime alike
            for label in models:
                timings[label].add(**(torch_decode(models[label], prompt, tokens) if label in torch_models
                                      else onnx_decode(runners[label], prompt.numpy(), tokens)))
    bandwidth = measure_bandwidth()
    rows = []
    ms = {label: timing.median_ms() for label, timing in timings.items()}
    for label, timing in timings.items():
        floor = weight_bytes_per_token(models[label]) / bandwidth
        seconds = ms[label] / 1e3
        rows.append({"runtime": label, "ms_per_token": ms[label], "cpu_ms_per_token": timing.median_ms("process"),
                     "speedup_vs_torch": ms["torch float32"] / ms[label],
                     "weight_mib_per_token": weight_bytes_per_token(models[label]) / 2**20,
                     "floor_ms": 1e3 * floor, "fraction_of_floor": floor / seconds, "rel_error": rel_errors.get(label)})
    return {"tokens": tokens, "repeats": repeats, "threads": threads, "max_len": max_len,
            "bandwidth_gb_s": bandwidth / 1e9, "rows": rows}


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result['model']} decode, batch 1, {result['threads']} threads, median of {result['repeats']} × "
                        f"{result['tokens']} tokens, ONNX cache length {result['max_len']}; "
                        f"copy bandwidth {result['bandwidth_gb_s']:.1f} GB/s")
    for col in ("runtime", "ms/token", "CPU ms/token", "× torch", "weights MiB/token", "floor ms", "floor / measured",
                "rel. error"):
        table.add_column(col, justify="left" if col == "runtime" else "right")
    for r in result["rows"]:
        table.add_row(r["runtime"], f"{r['ms_per_token']:.2f}", f"{r['cpu_ms_per_token']:.2f}", f"{r['speedup_vs_torch']:.2f}",
                      f"{r['weight_mib_per_token']:.1f}",
                      f"{r['floor_ms']:.2f}", f"{100 * r['fraction_of_floor']:.0f}%",
                      "" if r["rel_error"] is None else f"{r['rel_error']:.1e}")
    Console().print(table)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a built-in model or a checkpoint path")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--accuracy-levels", default="0,4", help="MatMulNBits accuracy_level of each INT4 bundle")
    parser.add_argument("--attention", default="gqa", help=f"attention of each ONNX bundle, a comma list of {', '.join(ATTENTION)}")
    parser.add_argument("--max-len", type=int, help="the ONNX bundles' cache length (default: prompt + tokens + 1)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    attention = args.attention.split(",")
    if unknown := set(attention) - set(ATTENTION):
        parser.error(f"--attention {', '.join(sorted(unknown))}: not one of {', '.join(ATTENTION)}")
    result = run(args.tokens, args.repeats, args.threads, [int(v) for v in args.accuracy_levels.split(",")], attention,
                 args.max_len, args.model)
    print_table({**result, "model": args.model})
    rows = result.pop("rows")
    return write_result(args.json, rows, model=args.model, **result)


if __name__ == "__main__":
    main()
