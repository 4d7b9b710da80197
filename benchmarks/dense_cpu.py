"""Float32 linear layers on the CPU: MKL's ``F.linear``, oneDNN and qcompile's kernel on packed weights, by rows.

    python benchmarks/dense_cpu.py [--threads 2] [--rows 1,2,3,4,16,64,512] [--layers 30] [--repeats 10] [--modules] [--int4]
        [--int8] [--isa avx2,avx512_bf16]

The layers are SmolLM2's decoder projections as the engine runs them (q/k/v fused 576 -> 960,
o 576 -> 576, gate/up fused 576 -> 3072, down 1536 -> 576), ``--layers`` copies of each, so that the
weights (SmolLM2's 425 MB at 30 layers) are cold in cache as in a decode step. Prints ms for one
pass over all of them per way (the median of ``--repeats`` passes after one untimed, ``benchmarks/common.py``;
``--json`` also writes the rows, with each median's p90); ``compiler/kernels/dispatch.py``
chooses its packed way and oneDNN's crossover (per CPU vendor) from it. qcompile's columns need the
C++ kernels ("-" where they are not loaded); ``--isa`` runs them at each ISA level given (levels the
CPU runs: ``compiler/kernels/cpu_isa.py``), one table each, instead of the process's level.

``--modules`` adds the layers as the engine calls them, Python included: float's ``PackedLinear``
and ``Fp8Linear`` (W8A8 per token with the input shift, ``examples/fp8.toml``'s format) with its
float copy packed (``pack_linears``), so the FP8 column is float's matmul plus what FP8 adds.

``--int4`` adds the same layers as ``Int4Linear`` (round to nearest, group 64, 128 for the 1536-wide
input, as AWQ's fallback gives SmolLM2), called as the engine does: W4A16 (torch's INT4 kernel below
256 rows, ``int4_dense_linear`` from there) and W4A8 (``int4_compute = "w4a8"``: ``w4a8_linear``).

``--int8`` adds them as int8 weights (``compiler/quant/int8.py``) times int8 activations quantized
per token, symmetric: qcompile's ``w8a8_linear`` (the quantization inside the call), and torch's
``torch._int_mm`` on the weight transposed once, the activations quantized and the output scaled
by torch ops (``quantize_per_token``, then ``int8_gemm``'s scaling).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import measure, write_result  # noqa: E402
from compiler.kernels.cpu_ext import cpu_isa_in_use, cpu_kernels, use_isa  # noqa: E402
from compiler.kernels.dense_cpu import pack_dense_weight  # noqa: E402
from serving.bench.environment import cpu_model  # noqa: E402

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)


def pass_ms(weights: list, inputs: dict[int, torch.Tensor], linear, repeats: int, record: dict | None = None,
            key: str = "") -> float:
    """The median ms of one pass over ``weights`` (the warm-up builds oneDNN's primitive per shape); its
    statistics go into ``record[key]``."""
    def one_pass():
        for w in weights:
            linear(inputs[w.shape[1]], w)  # a packed weight keeps its [out, in] sizes

    stats = measure(one_pass, repeats).stats()
    if record is not None:
        record[key] = {"ms": stats["p50"], "p90_ms": stats["p90"]}
    return stats["p50"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,3,4,16,64,512")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--modules", action="store_true", help="also time PackedLinear and Fp8Linear modules")
    p.add_argument("--int4", action="store_true", help="also time Int4Linear modules, W4A16 and W4A8")
    p.add_argument("--int8", action="store_true", help="also time W8A8: w8a8_linear and torch._int_mm")
    p.add_argument("--isa", help="ISA levels to run qcompile's kernels at, a comma list (default: the process's)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for _ in range(args.layers) for k, n in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    ours = [_Packed(pack_dense_weight(w), w.shape) for w in weights] if cpu_kernels() is not None else []
    float_modules, fp8_modules = engine_modules(weights) if args.modules else ([], [])
    w4a16_modules, w4a8_modules = int4_modules(weights) if args.int4 else ([], [])
    int8_weights = [_Int8(w) for w in weights] if args.int8 else []
    rows = []
    for level in args.isa.split(",") if args.isa else [cpu_isa_in_use()]:
        with use_isa(level) if level else contextlib.nullcontext():
            print(f"{args.layers} layers x {len(SHAPES)} projections, float32, {args.threads} threads, qcompile's kernels "
                  f"at {level or 'none'} ({cpu_model()}): ms per pass")
            rows += print_table(args, weights, packed, ours, float_modules, fp8_modules, w4a16_modules, w4a8_modules,
                                int8_weights, level)
    return write_result(args.json, rows, layers=args.layers, threads=args.threads, shapes=SHAPES)


def print_table(args, weights, packed, ours, float_modules, fp8_modules, w4a16_modules, w4a8_modules,
                int8_weights, level: str | None) -> list[dict]:
    onednn = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
    ops = cpu_kernels()
    print(f"{'rows':>6} {'F.linear (MKL)':>16} {'oneDNN packed':>15} {'qcompile packed':>17}"
          + (f" {'PackedLinear':>13} {'Fp8Linear':>10}" if args.modules else "")
          + (f" {'INT4 W4A16':>11} {'INT4 W4A8':>10}" if args.int4 else "")
          + (f" {'W8A8 qcompile':>14} {'W8A8 _int_mm':>13}" if args.int8 else ""))
    table = []
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {k: torch.randn(rows, k) for k in {k for k, _ in SHAPES}}
            row = {"isa": level, "rows": rows}
            mkl = pass_ms(weights, inputs, lambda x, w: F.linear(x, w), args.repeats, row, "mkl")
            dnn = pass_ms(packed, inputs, onednn, args.repeats, row, "onednn")
            own = (f"{pass_ms(ours, inputs, lambda x, p: ops.dense_linear(x, p.packed, p.shape[0], None), args.repeats, row, 'qcompile'):.1f}"
                   if ours else "-")
            line = f"{rows:>6} {mkl:>16.1f} {dnn:>15.1f} {own:>17}"
            if args.modules:
                line += f" {pass_ms(float_modules, inputs, call, args.repeats, row, 'packed_linear'):>13.1f}"
                line += f" {pass_ms(fp8_modules, inputs, call, args.repeats, row, 'fp8_linear'):>10.1f}"
            if args.int4:
                line += f" {pass_ms(w4a16_modules, inputs, call, args.repeats, row, 'int4_w4a16'):>11.1f}"
                line += f" {pass_ms(w4a8_modules, inputs, call, args.repeats, row, 'int4_w4a8'):>10.1f}"
            if args.int8:
                own8 = f"{pass_ms(int8_weights, inputs, _Int8.w8a8, args.repeats, row, 'w8a8_qcompile'):.1f}" if ops is not None else "-"
                line += f" {own8:>14} {pass_ms(int8_weights, inputs, _Int8.int_mm, args.repeats, row, 'w8a8_int_mm'):>13.1f}"
            print(line)
            table.append(row)
    return table


class _Packed:
    """A weight in ``dense_linear``'s layout, with the [out, in] sizes ``pass_ms`` reads."""

    def __init__(self, packed: torch.Tensor, shape: torch.Size):
        self.packed, self.shape = packed, shape


class _Int8:
    """A weight as int8 codes and scales (compiler/quant/int8.py): w8a8_linear's pack, and the codes
    transposed once for torch._int_mm; ``shape`` as ``pass_ms`` reads it."""

    def __init__(self, w: torch.Tensor):
        from compiler.kernels.w8a8_cpu import pack_w8a8
        from compiler.quant.int8 import quantize_weight, weight_scale

        self.scale = weight_scale(w)
        codes = quantize_weight(w, self.scale)
        self.pack, self.codes_t, self.shape = pack_w8a8(codes), codes.t().contiguous(), w.shape

    @staticmethod
    def w8a8(x: torch.Tensor, layer: _Int8) -> torch.Tensor:
        from compiler.kernels.w8a8_cpu import w8a8_matmul

        return w8a8_matmul(x, layer.pack, layer.scale)

    @staticmethod
    def int_mm(x: torch.Tensor, layer: _Int8) -> torch.Tensor:
        from compiler.quant.int8 import quantize_per_token

        q, s, _ = quantize_per_token(x)
        return torch._int_mm(q, layer.codes_t).float() * (s * layer.scale[None, :])


class _Layer(torch.nn.Module):
    """A module with the input width ``pass_ms`` reads from ``.shape[1]``."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module, self.shape = module, (module.out_features, module.in_features)


def call(x: torch.Tensor, layer: _Layer) -> torch.Tensor:
    return layer.module(x)


def engine_modules(weights: list[torch.Tensor]) -> tuple[list[_Layer], list[_Layer]]:
    """Each weight as float's PackedLinear and as a per-token W8A8 Fp8Linear, packed as the engine packs them."""
    from compiler.formats.fp8 import Fp8Format, Fp8Linear
    from compiler.kernels.dense_cpu import pack_linears

    float_modules, fp8_modules = [], []
    for w in weights:
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w
        fmt = Fp8Format.for_linear(linear, input_shift=True)
        fp8 = Fp8Linear.from_linear(linear, fmt, None, input_shift=torch.zeros(w.shape[1]))
        holder = torch.nn.ModuleList([linear, fp8])
        pack_linears(holder)  # the linear becomes a PackedLinear, the Fp8Linear packs its float copy
        float_modules.append(_Layer(holder[0]))
        fp8_modules.append(_Layer(holder[1]))
    return float_modules, fp8_modules


def int4_modules(weights: list[torch.Tensor]) -> tuple[list[_Layer], list[_Layer]]:
    """Each weight as an Int4Linear on W4A16 and on W4A8 (packed now, as the engine packs at load)."""
    from compiler.formats.int4 import Int4Linear

    w4a16, w4a8 = [], []
    for w in weights:
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w
        layer = Int4Linear.from_float(linear, 64 if w.shape[1] % 128 else 128)
        fast = copy.deepcopy(layer)
        if why := fast.use_w4a8():
            raise SystemExit(f"W4A8 cannot run here: {why}")
        fast.w4a8_pack()
        w4a16.append(_Layer(layer))
        w4a8.append(_Layer(fast))
    return w4a16, w4a8


if __name__ == "__main__":
    main()
