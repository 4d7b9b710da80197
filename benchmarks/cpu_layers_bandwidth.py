"""Decode on the CPU through Llama-sized decoder layers (random weights), as a share of the host's memory bandwidth.

    python benchmarks/cpu_layers_bandwidth.py [--threads 2] [--models llama-1b,llama3-8b-layer]
        [--formats float32,int4-g32,int4-g32-w4a8,int4-g128,int4-g128-w4a8,fp8] [--rows 1,16] [--context 128]
        [--clock wall|thread] [--llama-cpp-path /tmp/llama-native] [--work-dir /tmp/cpu_layers_bandwidth] [--json FILE] [--plot FILE]

SmolLM2-135M is small enough that per-token overhead hides the kernels (issue 42, item 6); these are not:

- ``llama-1b``: Llama-3.2-1B's shapes (hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 KV heads);
- ``llama3-8b-layer``: one decoder layer of Llama-3-8B's shapes (hidden 4096, intermediate 14336,
  32 heads, 8 KV heads, head_dim 128);

both with a vocabulary of ``--vocab`` (256) tokens, so that the embedding and the head are negligible
(2-4 MB) and a token's time is its decoder layers' time. Weights are random (their values do not
change the speed), in qcompile's own model, rounded to nearest per format: float32; INT4
(``Int4Linear.from_float``) at group 32 symmetric (llama.cpp's Q4_0 codes) and at group 128 with
zero points (the AWQ artifacts' layout), each served W4A16 (the default) and W4A8 (``int4_compute =
"w4a8"``); FP8 E4M3 per channel with per-token FP8 activations (``Fp8Linear.from_linear``).

Each model goes into the serving ``Engine`` as an artifact would (q/k/v and gate/up fused, float32
linears packed, the INT4 compute set, a paged float32 KV cache), and the forward of a decode step is
timed as the engine runs it: the embedding, every decoder layer with the paged cache, the head, for
``--rows`` sequences of one new token each (1, and 16 as in a batched step), each attending over
``--context`` cached positions (zeros: K/V values do not change the speed either). The same step is
repeated at the same position; ms is the median of ``--repeats`` steps after one untimed
(``benchmarks/common.py``). On a machine
other processes share, ``--threads 1 --clock thread`` times the thread's CPU time instead of the
wall's (at one thread every kernel, and llama.cpp, runs on the calling thread), so that the time
other processes hold the core is left out; what they take of the memory's bandwidth is not.

"weights MB" is the decoder layers' weights as the format stores them in a float32 model (the state
dict: INT4 codes, scales held in float32 and zero points; FP8 codes and per-row scales; float32
weights; the norms), read once per step at any row count. GB/s is that over the step's time, and
"% bw" its share of the host's read bandwidth on the same threads: the fastest of a sum, a max and
a dot product over a ``--bandwidth-gib`` float32 tensor (``read_gb_s``), probed before every row,
the best probe of the run taken (other processes' memory traffic lowers a probe, never raises it;
the lowest is printed too). qcompile's float32 kernel can stream faster than these reads (a share
above 100%): the figure is a floor of what the memory gives, not its peak. The goal of issue 42: INT4 decode at one row at
60% of it or more. (A kernel's own packed copy can hold more than the stored format, e.g. its
scales in float32 or bfloat16 with a zero term beside them.)

``--llama-cpp-path`` (a ``pip install --target DIR llama-cpp-python`` directory) adds llama.cpp on
the same weights: each model is written as a GGUF with ``gguf`` (llama.cpp's own writer; q/k rows
permuted for its RoPE, as its converter does) in F32, and in Q4_0 from the group-32 symmetric INT4
codes and scales themselves (qcompile's w = (q - 8)·s is Q4_0's w = (q - 8)·d, the nibbles in
Q4_0's order); llama-cpp-python then times one-token decode steps at the same context in a child
process (``Llama.eval``, rewound to the context before each step), the same threads. Its rows count
the GGUF's decoder-layer bytes; it has no 16-row figure here (its Python API decodes one sequence).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import CLOCKS, Timing, measure, write_result  # noqa: E402
from compiler.deploy.serving_plan import ServingPlan  # noqa: E402
from compiler.formats.fp8 import Fp8Linear  # noqa: E402
from compiler.formats.int4 import Int4Linear  # noqa: E402
from compiler.model.config import ModelConfig  # noqa: E402
from compiler.model.transformer import Transformer  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.paged_cache import BatchMetadata  # noqa: E402

MODELS = {
    "llama-1b": dict(dim=2048, intermediate_size=8192, n_layers=16, n_heads=32, n_kv_heads=8),  # Llama-3.2-1B
    "llama3-8b-layer": dict(dim=4096, intermediate_size=14336, n_layers=1, n_heads=32, n_kv_heads=8),
}


@dataclass(frozen=True)
class Format:
    name: str
    kind: str  # "float32", "int4" or "fp8"
    group_size: int = 0
    zero_point: bool = False
    int4_compute: str = "w4a16"


FORMATS = {f.name: f for f in (
    Format("float32", "float32"),
    Format("int4-g32", "int4", 32, False),  # symmetric: Q4_0's codes
    Format("int4-g32-w4a8", "int4", 32, False, "w4a8"),
    Format("int4-g128", "int4", 128, True),  # with zero points: the AWQ artifacts' layout
    Format("int4-g128-w4a8", "int4", 128, True, "w4a8"),
    Format("fp8", "fp8"),
)}
GGUF_FORMATS = {"F32": "float32", "Q4_0": "int4-g32"}  # GGUF type -> the format whose weights it holds

def model_config(name: str, vocab_size: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab_size, rope_theta=500000.0,
                       max_seq_len=4096, **MODELS[name])


def random_model(config: ModelConfig, seed: int = 0) -> Transformer:
    """The decoder with torch's own random initialisation: the same weights for the same seed."""
    torch.manual_seed(seed)
    return Transformer(config).eval().requires_grad_(False)


def quantize(model: Transformer, fmt: Format) -> Transformer:
    """Every decoder-layer projection in ``fmt``, in place (each float weight goes as it is replaced)."""
    if fmt.kind == "float32":
        return model
    for layer in model.layers:
        for parent in (layer.self_attn, layer.ffn):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, convert(child, fmt))
    return model


def convert(linear: nn.Linear, fmt: Format) -> nn.Module:
    if fmt.kind == "int4":
        return Int4Linear.from_float(linear, fmt.group_size, fmt.zero_point)
    return Fp8Linear.from_linear(linear)  # E4M3 per channel, dynamic per-token activations


def stored_bytes(module: nn.Module) -> int:
    """The bytes ``module``'s weights take as stored (its state dict; derived kernel copies are not in it)."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def kernel_of(engine: Engine, fmt: Format) -> str:
    """What the format's linears run in a decode step of this engine (its kernel report: the ISA level
    of qcompile's kernels named beside them)."""
    if fmt.kind in ("int4", "fp8"):
        return ", ".join(engine.load_report.kernels[fmt.kind]["decode"])
    return engine.load_report.kernels["linear"]


def serve(model: Transformer, fmt: Format, num_blocks: int) -> Engine:
    """The model as the serving engine prepares it (fusion, packing, INT4 compute, paged cache)."""
    return Engine(model, None, ServingPlan(num_blocks=num_blocks, int4_compute=fmt.int4_compute), device="cpu")


def blocks_per_sequence(context: int, block_size: int) -> int:
    return context // block_size + 1  # the context and the new token


def decode_inputs(engine: Engine, rows: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and positions [1, rows] of a decode step of ``rows`` sequences at position
    ``context``, and the cache's metadata for it (each sequence in blocks of its own)."""
    bs = engine.cache.spec.block_size
    per_seq = blocks_per_sequence(context, bs)
    tables = torch.arange(rows * per_seq).view(rows, per_seq)
    engine.cache.set_batch(BatchMetadata(
        slot_mapping=tables[:, context // bs] * bs + context % bs,
        decode_token_idx=torch.arange(rows),
        decode_block_tables=tables,
        decode_seq_lens=torch.full((rows,), context + 1),
    ))
    ids = torch.randint(0, engine.config.vocab_size, (1, rows))
    return ids, torch.full((1, rows), context)


def decode_step(engine: Engine, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The engine's forward of a decode step: embedding, decoder layers with the paged cache, head."""
    m = engine.model
    x = m.embed_tokens(ids)
    cos, sin = m.rope(positions, x.dtype)
    for layer in m.layers:
        x = layer(x, cos, sin, positions, engine.cache)
    return m.logits(x[0])


# "wall": elapsed time; "thread": the calling thread's CPU time, which at one thread (where torch's
# and llama.cpp's work runs on the calling thread) leaves out the time other processes hold the core.
CLOCK_NAMES = ("wall", "thread")


def step_ms(fn, repeats: int, clock: str) -> float:
    """ms per call on ``clock``: the median of ``repeats`` calls after one untimed (packs built on first use)."""
    return measure(fn, repeats, clocks=(clock,)).median_ms(clock)


def read_gb_s(t: torch.Tensor, clock: str, runs: int = 5) -> float:
    """GB/s of a plain read of ``t``, a large float32 tensor, on torch's threads: the fastest of
    three reductions over it, each its fastest of ``runs`` (a probe of what the memory gives: another
    process's traffic slows a read, never speeds it): their arithmetic costs less than the read (on
    one core of the AMD EPYC, over 8 MB in cache: 52-93 GB/s), but how fast they stream from memory
    differs (over 1 GiB: a sum 17.7, a max 22.5, a dot product with itself 22.4 GB/s)."""
    reads = (t.sum, t.amax, lambda: torch.dot(t, t))
    seconds = min(measure(read, runs, clocks=(clock,)).stats(clock)["min"] for read in reads) / 1e3
    return t.numel() * t.element_size() / seconds / 1e9


def figures(weight_bytes: int, ms: float) -> dict:
    return {"ms": ms, "gb_s": weight_bytes / ms / 1e6}


def add_shares(rows: list[dict], bandwidth: float) -> None:
    """Each figure's GB/s as a share of ``bandwidth``."""
    for row in rows:
        for key, f in row.items():
            if key.startswith("rows_"):
                f["share_of_bandwidth"] = f["gb_s"] / bandwidth


def format_row(model_name: str, fmt: Format, args) -> dict:
    """One table row: the format's decode step at each row count."""
    config = model_config(model_name, args.vocab)
    model = quantize(random_model(config), fmt)
    weight_bytes = stored_bytes(model.layers)
    blocks = max(args.rows) * blocks_per_sequence(args.context, ServingPlan().block_size)
    engine = serve(model, fmt, blocks)
    row = {"model": model_name, "format": fmt.name, "kernel": kernel_of(engine, fmt), "weight_bytes": weight_bytes}
    with torch.inference_mode():
        for rows in args.rows:
            ids, positions = decode_inputs(engine, rows, args.context)
            logits = decode_step(engine, ids, positions)
            if not torch.isfinite(logits).all():
                raise RuntimeError(f"{model_name} {fmt.name}: non-finite logits at {rows} rows")
            ms = step_ms(lambda: decode_step(engine, ids, positions), args.repeats, args.clock)
            row[f"rows_{rows}"] = figures(weight_bytes, ms)
    row["load_average"] = os.getloadavg()[0]
    return row


# -- llama.cpp on the same weights ------------------------------------------------------------


def add_placeholder_vocab(w, vocab_size: int) -> None:
    """A SentencePiece-type vocabulary of placeholder pieces: llama.cpp loads no model without a
    vocabulary, and it is fed token ids only."""
    import gguf

    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"<t{i}>" for i in range(3, vocab_size)])
    w.add_token_scores([0.0] * vocab_size)
    types = gguf.TokenType
    w.add_token_types([types.UNKNOWN, types.CONTROL, types.CONTROL] + [types.NORMAL] * (vocab_size - 3))
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_gguf(model: Transformer, path: Path) -> int:
    """Write ``model`` (float32, or with group-32 symmetric INT4 projections: Q4_0, codes and scales
    unchanged) as a llama GGUF, by the GGUF target's own metadata and tensor code; returns its
    decoder layers' bytes."""
    import gguf

    from backends.gguf.export import model_tensors, write_metadata

    w = gguf.GGUFWriter(str(path), "llama")
    write_metadata(w, model.config)
    add_placeholder_vocab(w, model.config.vocab_size)
    layer_bytes = 0
    for name, stored in model_tensors(model, model.config, "F32", notes=[]):
        raw = None if stored.qtype == "F32" else gguf.GGMLQuantizationType[stored.qtype]
        w.add_tensor(name, stored.data, raw_dtype=raw)
        layer_bytes += stored.data.nbytes if name.startswith("blk.") else 0
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return layer_bytes


LLAMA_CPP_SCRIPT = r"""
import json, sys, time
import llama_cpp
cfg = json.loads(sys.stdin.read())
clock = getattr(time, cfg["clock"])
llm = llama_cpp.Llama(model_path=cfg["gguf"], n_ctx=cfg["n_ctx"], n_threads=cfg["threads"],
                      n_threads_batch=cfg["threads"], n_batch=512, verbose=False)
llm.eval(cfg["prompt"])
def step():
    llm.n_tokens = len(cfg["prompt"])  # eval drops the cache from here on: every step decodes this position
    llm.eval([cfg["token"]])
step()
seconds = []
for _ in range(cfg["repeats"]):
    start = clock()
    step()
    seconds.append(clock() - start)
print(json.dumps({"seconds": seconds, "version": llama_cpp.__version__,
                  "system_info": llama_cpp.llama_print_system_info().decode()}))
"""


def run_llama_cpp(gguf_path: Path, args) -> dict:
    """llama.cpp's one-token decode step on ``gguf_path`` in a child process importing from ``--llama-cpp-path``."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, args.vocab, (args.context,), generator=gen).tolist()
    cfg = {"gguf": str(gguf_path), "n_ctx": args.context + 64, "threads": args.threads, "prompt": prompt,
           "token": prompt[-1], "repeats": args.repeats, "clock": CLOCKS[args.clock].__name__}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(args.llama_cpp_path)
    done = subprocess.run([sys.executable, "-c", LLAMA_CPP_SCRIPT], input=json.dumps(cfg), text=True,
                          capture_output=True, env=env, timeout=args.llama_cpp_timeout)
    if done.returncode:
        raise RuntimeError(f"llama.cpp exited with code {done.returncode}: {done.stderr.strip().splitlines()[-3:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_llama_cpp(model_name: str, args) -> list[dict]:
    """Rows of llama.cpp on the model's weights, in F32 and in Q4_0 (written first, then timed)."""
    config = model_config(model_name, args.vocab)
    rows = []
    for gguf_type, fmt_name in GGUF_FORMATS.items():
        path = args.work_dir / f"{model_name}-{gguf_type}.gguf"
        layer_bytes = write_gguf(quantize(random_model(config), FORMATS[fmt_name]), path)
        out = run_llama_cpp(path, args)
        ms = Timing({"wall": out["seconds"]}).median_ms()  # the child's steps on args.clock
        rows.append({"model": model_name, "format": f"llama.cpp {gguf_type}", "kernel": "llama.cpp",
                     "weight_bytes": layer_bytes, "rows_1": figures(layer_bytes, ms),
                     "load_average": os.getloadavg()[0], "llama_cpp_version": out["version"],
                     "system_info": out["system_info"]})
        path.unlink()  # several GB for the float 1B model
    return rows


# -- the report -------------------------------------------------------------------------------


def cpu_description() -> str:
    """The CPU's name and the vector extensions that decide the kernels, from /proc/cpuinfo."""
    name, flags = "unknown CPU", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            name = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            break
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name} ({' '.join(isa) or 'no AVX2'}{'' if 'amx_tile' in flags else ', no AMX'})"


def print_table(rows: list[dict], meta: dict, row_counts: list[int]) -> None:
    def cell(row: dict, rows_: int) -> str:
        f = row.get(f"rows_{rows_}")
        return "— | — | —" if f is None else f"{f['ms']:.2f} | {f['gb_s']:.1f} | {100 * f['share_of_bandwidth']:.0f}%"

    threads = f"{meta['threads']} thread{'s' if meta['threads'] > 1 else ''}"
    print(f"\nCPU: {meta['cpu']}; {threads}; torch {meta['torch']} ({meta['torch_cpu_capability']}); "
          f"{meta['clock']} time")
    print(f"read bandwidth: {meta['bandwidth_gb_s']:.1f} GB/s (a sum, max or dot over a {meta['bandwidth_gib']} GiB float32 tensor, "
          f"the best of {len(meta['bandwidth_probes'])} probes, the lowest {min(meta['bandwidth_probes']):.1f}); context {meta['context']} tokens, vocabulary {meta['vocab']}; load average "
          f"{meta['load_average_start']:.1f} at the start, {meta['load_average_end']:.1f} at the end")
    header = " | ".join(f"{r} row{'s' if r > 1 else ''}: ms/step | GB/s | % bw" for r in row_counts)
    print(f"| model | format | kernel | weights MB | {header} |")
    print("|---|---|---|---:|" + "---:|---:|---:|" * len(row_counts))
    for row in rows:
        cells = " | ".join(cell(row, r) for r in row_counts)
        print(f"| {row['model']} | {row['format']} | {row['kernel']} | {row['weight_bytes'] / 1e6:.1f} | {cells} |")


def plot(rows: list[dict], meta: dict, row_counts: list[int], path: Path) -> None:
    """Per model, bars of GB/s per format and row count; the measured bandwidth and the 60% goal as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    width = 0.8 / len(row_counts)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        for i, n in enumerate(row_counts):
            values = [r[f"rows_{n}"]["gb_s"] if f"rows_{n}" in r else 0 for r in mine]
            ax.bar([x + i * width for x in range(len(mine))], values, width, label=f"{n} row{'s' if n > 1 else ''}")
        bw = meta["bandwidth_gb_s"]
        ax.axhline(bw, color="black", label=f"read bandwidth {bw:.1f} GB/s")
        ax.axhline(0.6 * bw, color="black", linestyle="--", label="60% of it (the INT4 goal)")
        ax.set_xticks([x + width * (len(row_counts) - 1) / 2 for x in range(len(mine))])
        ax.set_xticklabels([r["format"] for r in mine], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("weights read, GB/s")
        ax.set_ylim(0, 1.35 * max(bw, *(r[k]["gb_s"] for r in mine for k in r if k.startswith("rows_"))))  # room for the legend
        ax.set_title(f"{model}, {meta['threads']} thread{'s' if meta['threads'] > 1 else ''}, {meta['clock']} time")
        ax.legend(fontsize=7)
    fig.suptitle(meta["cpu"], fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"of {', '.join(FORMATS)}")
    p.add_argument("--rows", default="1,16", help="sequences per decode step, one token each")
    p.add_argument("--context", type=int, default=128, help="cached positions each sequence attends over")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5, help="timed decode steps (their median)")
    p.add_argument("--clock", choices=CLOCK_NAMES, default="wall",
                   help="wall time, or (with --threads 1) the thread's CPU time, for a machine other processes share")
    p.add_argument("--bandwidth-gib", type=float, default=1.0)
    p.add_argument("--llama-cpp-path", type=Path, help="a directory llama_cpp imports from (pip install --target)")
    p.add_argument("--llama-cpp-timeout", type=int, default=900, help="seconds one llama.cpp child may take")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/cpu_layers_bandwidth"), help="where the GGUFs are written")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",")]
    models, formats = args.models.split(","), args.formats.split(",")
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(formats) - set(FORMATS))
    if unknown:
        p.error(f"unknown model or format: {', '.join(unknown)}")
    if args.clock == "thread" and args.threads != 1:
        p.error("--clock thread counts the calling thread's CPU time only: it needs --threads 1")
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    clock = args.clock
    probe = torch.ones(int(args.bandwidth_gib * 2**30) // 4)  # written once, so that every page is mapped
    probes = []
    rows = []
    for model_name in models:
        for fmt_name in formats:
            probes.append(read_gb_s(probe, clock))
            rows.append(format_row(model_name, FORMATS[fmt_name], args))
            gc.collect()  # the last format's model and engine go before the next is built (the 1B float: 8 GB)
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.llama_cpp_path:
            args.work_dir.mkdir(parents=True, exist_ok=True)
            probes.append(read_gb_s(probe, clock))
            rows += measure_llama_cpp(model_name, args)
            print(json.dumps(rows[-2:]), file=sys.stderr, flush=True)
    add_shares(rows, max(probes))
    meta = {"cpu": cpu_description(), "threads": args.threads, "clock": args.clock, "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "bandwidth_gb_s": max(probes),
            "bandwidth_probes": probes, "bandwidth_gib": args.bandwidth_gib, "context": args.context, "vocab": args.vocab,
            "load_average_start": load_start, "load_average_end": os.getloadavg()[0]}
    print_table(rows, meta, args.rows)
    if args.plot:
        plot(rows, meta, args.rows, args.plot)
    return write_result(args.json, rows, **meta, repeats=args.repeats,
                        llama_cpp_path=str(args.llama_cpp_path) if args.llama_cpp_path else None)


if __name__ == "__main__":
    main()
