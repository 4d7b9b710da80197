"""The OpenAI Triton kernels on a CUDA GPU: correctness against torch references, then speed.

One run, in four parts, all on fresh random inputs:

1. FP8 W8A8 GEMM (``compiler.kernels.fp8``) and ``torch._scaled_mm`` against the dequantize
   reference, per-token/per-channel and per-tensor scales, with bias, activations reaching far
   beyond E4M3's range (cast with a saturating static scale as well as per-token scales); the
   fused activation cast against torch's on the CPU, bitwise.
2. W4A16 INT4 GEMM (``compiler.kernels.w4a16``) against dequantize-then-matmul in float32,
   including K not divisible by the group (SmolLM2's 576 at g128); the dequantize kernel bitwise.
3. A SmolLM2-135M-shaped model (random weights) with every decoder Linear converted to FP8 (with and
   without an input shift, and with 32 outlier channels in bf16 besides the shift) or INT4:
   logits on the GPU (Triton kernels) against the same model on the CPU (torch reference paths),
   next to the CPU model's own spread when each FP8 GEMM output is perturbed by 1e-3 (FP8
   activation rounding turns tiny differences into whole-step flips, layer after layer).
4. Speed: each kernel over a sweep of tile configurations, against a bf16 ``x @ w.T`` (cuBLAS)
   in the same run, median ms of CUDA-graph replays (``triton.testing.do_bench_cudagraph``: the
   host's launch overhead is left out, as under a serving engine's graphs), plus eager timings of
   the layers as a model calls them; on Llama-8B and SmolLM2 shapes.

Every correctness figure of parts 1-3 has a bound (``BOUNDS``, ``out_of_bounds``): after all parts
have run and the JSON is written, a figure out of its bound, or a part that raised, fails the run
(exit 1, each failed check named on stderr).

    python benchmarks/gpu_kernels.py --json gpu_kernels.json
    TRITON_INTERPRET=1 python benchmarks/gpu_kernels.py --smoke   # CPU dry run of parts 1-3
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compiler.kernels.fp8_gemm  # noqa: E402
from benchmarks.common import write_result  # noqa: E402
from compiler.formats.fp8 import Fp8Format, Fp8Linear  # noqa: E402
from compiler.formats.int4 import Int4Linear  # noqa: E402
from compiler.kernels.fp8 import default_config, triton_fp8_gemm, triton_quantize_rows  # noqa: E402
from compiler.kernels.fp8_gemm import dequant_gemm, scaled_mm_gemm  # noqa: E402
from compiler.kernels.w4a16 import w4_dequantize, w4a16_matmul  # noqa: E402
from compiler.model.config import ModelConfig  # noqa: E402
from compiler.model.transformer import Transformer  # noqa: E402
from compiler.quant.fp8 import quantize, quantize_per_token, quantize_per_token_group  # noqa: E402

E4M3 = torch.float8_e4m3fn
FP8_KEYS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "precise_acc")
FP8_CONFIGS = [
    (64, 64, 128, 4, 4, False), (64, 32, 128, 4, 4, False), (64, 64, 256, 4, 3, False), (64, 128, 128, 4, 4, False),
    (128, 128, 128, 8, 4, False), (128, 128, 128, 8, 3, False), (128, 256, 128, 8, 3, False),
    (128, 128, 128, 8, 3, True),
]
W4_KEYS = ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages")
W4_CONFIGS = [
    (16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4), (16, 64, 128, 2, 4, 4), (16, 64, 128, 4, 4, 4),
    (16, 32, 128, 4, 4, 4), (16, 128, 128, 2, 4, 4), (16, 64, 64, 4, 4, 4), (16, 32, 64, 2, 4, 4),
    (32, 64, 128, 2, 4, 3), (64, 64, 128, 1, 4, 3), (64, 128, 128, 1, 4, 3),
]
LLAMA8B = [("q/o 4096→4096", 4096, 4096), ("gate/up 4096→14336", 4096, 14336), ("down 14336→4096", 14336, 4096)]
SMOLLM2 = [("gate/up 576→1536", 576, 1536), ("down 1536→576", 1536, 576)]

# Bounds of the correctness figures, per device ("cpu": the --smoke run in Triton's interpreter).
# Relative errors against the float32/float64 torch reference; True: must hold. On CUDA they leave
# 2-4x headroom over the H200 run (docs/data/gpu_kernels_h200.json): FP8 GEMM 4.1e-4..4.4e-3 (Hopper's
# FP8 accumulation; K up to 14336), precise_acc <= 4.0e-4, _scaled_mm <= 1.8e-3 (bf16 output);
# W4A16 float16 <= 2.2e-4, bfloat16 <= 1.7e-3 (the weight rounded to the activations' dtype).
BOUNDS = {
    "cuda": {
        "fp8_correctness": {"triton": 1e-2, "triton_group": 1e-2, "triton_precise_acc_False": 1e-2,
                            "triton_precise_acc_True": 1e-3, "scaled_mm": 5e-3,
                            "cast_codes_equal_cpu": True, "cast_scales_equal_cpu": True},
        "w4a16_correctness": {"torch.float16": 1e-3, "torch.bfloat16": 6e-3, "dequant_kernel_bitwise": True},
    },
    "cpu": {
        "fp8_correctness": {"triton": 1e-5, "triton_group": 1e-5},
        "w4a16_correctness": {"torch.float32": 1e-5},
    },
}
INT4_MODEL_BOUND = 1e-2  # INT4 model logits, GPU against CPU (H200: 1.5e-3)
# FP8 model logits, GPU against CPU: within this factor of the CPU model's own spread when each FP8 GEMM
# output is perturbed by 1e-3 (H200: 1.03x; FP8 activation rounding turns tiny differences into whole steps).
FP8_MODEL_SPREAD_FACTOR = 2.0


def out_of_bounds(results: dict, device: str) -> list[str]:
    """Every correctness check of ``results`` that is out of its bound (or did not run), named."""
    bounds = BOUNDS[device]
    failed = []

    def check(part: str, row: dict, key: str, value, bound) -> None:
        ok = value is True if bound is True else isinstance(value, float) and value <= bound  # NaN fails too
        if not ok:
            label = {k: row[k] for k in ("shape", "per_tensor", "bias", "group", "dtype", "format", "tokens") if k in row}
            failed.append(f"{part} {label}: {key} = {value} (bound {bound})")

    for part in ("fp8_correctness", "w4a16_correctness", "model_correctness"):
        rows = results.get(part)
        if not isinstance(rows, list):
            failed.append(f"{part}: did not run ({rows})")
            continue
        for row in rows:
            if part == "fp8_correctness":
                for key, bound in bounds[part].items():
                    if key in row:
                        check(part, row, key, row[key], bound)
            elif part == "w4a16_correctness":
                for key in ("rel", "int4linear_rel"):
                    check(part, row, key, row[key], bounds[part][row["dtype"]])
                if "dequant_kernel_bitwise" in bounds[part]:
                    check(part, row, "dequant_kernel_bitwise", row.get("dequant_kernel_bitwise"), True)
            elif row["format"] == "int4":
                check(part, row, "rel_gpu_vs_cpu", row["rel_gpu_vs_cpu"], INT4_MODEL_BOUND)
            else:
                spread = row["cpu_spread_at_1e-3"]
                check(part, row, "rel_gpu_vs_cpu", row["rel_gpu_vs_cpu"], max(FP8_MODEL_SPREAD_FACTOR * spread, 1e-5))
    return failed


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error; NaN or Inf anywhere gives inf, so it never passes a bound."""
    a, b = a.double().cpu(), b.double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm())


def wild_activations(m: int, k: int, device) -> torch.Tensor:
    """Gaussian activations with a few channels and tokens 1e3-1e5× larger (LLM-like outliers)."""
    x = torch.randn(m, k, device=device)
    x[:, torch.randperm(k, device=device)[:4]] *= 1e3
    x[torch.randperm(m, device=device)[: max(1, m // 8)]] *= 1e2
    return x


def check_fp8(device, smoke: bool) -> list[dict]:
    rows = []
    shapes = [(5, 64, 48), (33, 96, 80)] if smoke else [(1, 576, 192), (17, 576, 1536), (300, 1536, 576),
                                                      (1024, 4096, 4096), (77, 14336, 4096)]
    for m, k, n in shapes:
        for per_tensor in (False, True):
            for bias in (False, True):
                torch.manual_seed(m * 7 + k + n + per_tensor * 3 + bias)
                x = wild_activations(m, k, device)
                w = torch.randn(n, k, device=device) * 0.05
                b = torch.randn(n, device=device) if bias else None
                if per_tensor:  # a static scale that is too small: the cast must saturate, not overflow
                    xs = torch.tensor([float(x.abs().max()) / 448 / 50], device=device)
                    xq = quantize(x, xs, E4M3)
                    ws = (w.abs().max() / 448).reshape(1)
                else:
                    xq, xs = quantize_per_token(x, E4M3)
                    ws = w.abs().amax(1) / 448
                wq = quantize(w, ws[:, None] if ws.numel() > 1 else ws, E4M3)
                ref = dequant_gemm(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), None if b is None else b.cpu())
                row = {"shape": [m, k, n], "per_tensor": per_tensor, "bias": bias,
                       "triton": rel(triton_fp8_gemm(xq, xs, wq, ws, b), ref),
                       # share of activations the cast clipped to ±448 (only the too-small static scale clips)
                       "saturated_fraction": float((x.abs() / xs.reshape(-1, 1) > 448 * 1.001).float().mean())}
                if not per_tensor:  # activation scales per token and group of 32 (smoke) or 64 channels
                    xg, sg = quantize_per_token_group(x, E4M3, 32 if smoke else 64)
                    ref_g = dequant_gemm(xg.cpu(), sg.cpu(), wq.cpu(), ws.cpu(), None if b is None else b.cpu())
                    row["triton_group"] = rel(triton_fp8_gemm(xg, sg, wq, ws, b), ref_g)
                if device.type == "cuda":
                    row["scaled_mm"] = attempt(lambda: rel(scaled_mm_gemm(xq, xs, wq, ws, b), ref))
                    # the fused cast against torch's on the CPU, bitwise (torch on CUDA divides a tensor
                    # by a scalar through its reciprocal, so its scales may differ in the last bit)
                    tq, ts = triton_quantize_rows(x, E4M3, xs if per_tensor else None)
                    cq, cs = (quantize(x.cpu(), xs.cpu(), E4M3), xs.cpu()) if per_tensor else quantize_per_token(x.cpu(), E4M3)
                    row["cast_codes_equal_cpu"] = bool(torch.equal(tq.cpu().view(torch.uint8), cq.view(torch.uint8)))
                    row["cast_scales_equal_cpu"] = bool(torch.equal(ts.cpu(), cs))
                    for prec in (False, True):
                        cfg = {**default_config(m, n, k), "precise_acc": prec}
                        row[f"triton_precise_acc_{prec}"] = rel(triton_fp8_gemm(xq, xs, wq, ws, b, config=cfg), ref)
                rows.append(row)
    return rows


def check_w4a16(device, smoke: bool) -> list[dict]:
    rows = []
    cases = [(3, 96, 64, 64), (17, 200, 48, 128)] if smoke else [
        (1, 576, 192, 128), (16, 576, 1536, 64), (200, 1536, 576, 128), (1024, 4096, 4096, 128), (5, 14336, 4096, 128)]
    dtypes = [torch.float32] if device.type == "cpu" else [torch.float16, torch.bfloat16]
    for m, k, n, g in cases:
        for dtype in dtypes:
            torch.manual_seed(m + k + n + g)
            q = Int4Linear.from_float(nn.Linear(k, n, bias=True), g).to(device)
            q.scales, q.bias = q.scales.to(dtype), q.bias.to(dtype)
            x = torch.randn(m, k, device=device, dtype=dtype)
            ref = x.float().cpu() @ q.dequantized_weight().float().cpu().t() + q.bias.float().cpu()
            out = w4a16_matmul(x, q.qweight, q.scales, q.qzeros, k, g, q.bias)
            row = {"shape": [m, k, n], "group": g, "dtype": str(dtype), "rel": rel(out, ref),
                   "int4linear_rel": rel(q(x), ref)}  # the default dispatch (fused kernel or dequantize + cuBLAS)
            if device.type == "cuda":
                w = w4_dequantize(q.qweight, q.scales, q.qzeros, k, g, dtype)
                row["dequant_kernel_bitwise"] = bool(torch.equal(w.cpu(), q.cpu().dequantized_weight()))
                q.to(device)
            rows.append(row)
    return rows


def attempt(fn):
    """fn()'s value, or the error's name (one unsupported path must not hide the others' results)."""
    try:
        return fn()
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:200]}"


def bench_ms(fn, graph: bool = True) -> float:
    """Median ms. With ``graph`` the calls are replayed from a CUDA graph, so kernel time is measured
    without the host's launch overhead (what a serving engine's graphs see); else eager calls."""
    import triton.testing

    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def speed_fp8(device) -> list[dict]:
    rows = []
    for tokens in (16, 512, 4096):
        for name, k, n in LLAMA8B + (SMOLLM2 if tokens == 512 else []):
            torch.manual_seed(0)
            x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
            lin = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
            q = Fp8Linear.from_linear(lin)
            q64 = Fp8Linear.from_linear(lin, Fp8Format.for_linear(lin, activation_group_size=64))
            q_shift = Fp8Linear.from_linear(lin, Fp8Format.for_linear(lin, input_shift=True),
                                            input_shift=torch.randn(k, device=device))
            q_outliers = Fp8Linear.from_linear(lin, Fp8Format.for_linear(lin, input_shift=True, outlier_channels=32),
                                               input_shift=q_shift.input_shift,
                                               outliers=torch.randperm(k, device=device)[:32].sort().values)
            xq, xs = quantize_per_token(x, E4M3)
            flop = 2 * tokens * k * n
            base = bench_ms(lambda: lin(x))
            row = {"tokens": tokens, "shape": name, "bf16_ms": base, "bf16_tflops": flop / base / 1e9,
                   "scaled_mm_ms": attempt(lambda: bench_ms(
                       lambda: scaled_mm_gemm(xq, xs, q.weight, q.weight_scale, None, torch.bfloat16))),
                   "triton_default_ms": attempt(lambda: bench_ms(
                       lambda: triton_fp8_gemm(xq, xs, q.weight, q.weight_scale, None, torch.bfloat16))),
                   "fp8linear_ms": attempt(lambda: bench_ms(lambda: q(x))),  # cast + GEMM, as a model calls it
                   "fp8linear_group64_ms": attempt(lambda: bench_ms(lambda: q64(x))),
                   "fp8linear_shift_ms": attempt(lambda: bench_ms(lambda: q_shift(x))),  # input_shift fused in the cast
                   "fp8linear_outliers32_ms": attempt(lambda: bench_ms(lambda: q_outliers(x))),  # + a bf16 side product
                   "cast_torch_ms": bench_ms(lambda: quantize_per_token(x, E4M3)),
                   "cast_triton_ms": attempt(lambda: bench_ms(lambda: triton_quantize_rows(x, E4M3))),
                   "eager_bf16_ms": bench_ms(lambda: lin(x), graph=False),
                   "eager_fp8linear_ms": attempt(lambda: bench_ms(lambda: q(x), graph=False)), "triton": {}}
            for cfg in FP8_CONFIGS:  # a config may not fit shared memory
                row["triton"][str(cfg)] = attempt(lambda: bench_ms(
                    lambda: triton_fp8_gemm(xq, xs, q.weight, q.weight_scale, None, torch.bfloat16, dict(zip(FP8_KEYS, cfg)))))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def speed_w4a16(device) -> list[dict]:
    rows = []
    for tokens in (1, 16, 64, 128, 2048):
        for name, k, n in LLAMA8B + (SMOLLM2 if tokens == 16 else []):
            torch.manual_seed(0)
            g = 128 if k % 128 == 0 else 64
            lin = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
            q = Int4Linear.from_float(lin.float(), g).to(device)
            q.scales = q.scales.to(torch.bfloat16)
            lin = lin.to(torch.bfloat16)
            x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
            base = bench_ms(lambda: lin(x))
            row = {"tokens": tokens, "shape": name, "group": g, "bf16_ms": base,
                   "default_kernel_ms": attempt(lambda: bench_ms(
                       lambda: w4a16_matmul(x, q.qweight, q.scales, q.qzeros, k, g))),
                   "dequant_kernel_cublas_ms": attempt(lambda: bench_ms(lambda: F.linear(
                       x, w4_dequantize(q.qweight, q.scales, q.qzeros, k, g, x.dtype)))),
                   "int4linear_ms": attempt(lambda: bench_ms(lambda: q(x))),  # the default dispatch
                   "eager_bf16_ms": bench_ms(lambda: lin(x), graph=False),
                   "eager_int4linear_ms": attempt(lambda: bench_ms(lambda: q(x), graph=False)), "triton": {}}
            for cfg in W4_CONFIGS:
                row["triton"][str(cfg)] = attempt(lambda: bench_ms(
                    lambda: w4a16_matmul(x, q.qweight, q.scales, q.qzeros, k, g, None, dict(zip(W4_KEYS, cfg)))))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def smollm2_shaped(smoke: bool) -> Transformer:
    sizes = dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96) if smoke else \
        dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(architecture="LlamaForCausalLM", tie_embeddings=True, rope_theta=100000.0, **sizes)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() == 2 else None
    return model


def input_stats(model: Transformer, ids: torch.Tensor) -> dict[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Each decoder Linear's input channel means on ``ids`` (what the fp8 pass's input_shift stores)
    and its 32 channels of largest variance (its outlier_channels = 32)."""
    stats = {}

    def record(module, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        stats[module] = (x.mean(0), x.var(0).topk(32).indices.sort().values)

    linears = [m for layer in model.layers for m in layer.modules() if isinstance(m, nn.Linear)]
    hooks = [m.register_forward_pre_hook(record) for m in linears]
    model(ids)
    for h in hooks:
        h.remove()
    return stats


def convert(model: Transformer, fmt: str, stats: dict | None = None) -> Transformer:
    """Every decoder Linear as "fp8", "fp8-shift" (input_shift from ``stats``), "fp8-outliers" (the
    shift and 32 outlier channels) or "int4"."""
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    if fmt == "int4":
                        new = Int4Linear.from_float(child, 64)
                    else:
                        mean, outliers = stats[child] if stats else (None, None)
                        outliers = outliers if fmt == "fp8-outliers" else None
                        spec = Fp8Format.for_linear(child, input_shift=mean is not None,
                                                    outlier_channels=0 if outliers is None else len(outliers))
                        new = Fp8Linear.from_linear(child, spec, input_shift=mean, outliers=outliers)
                    setattr(parent, name, new)
    return model


@torch.no_grad()
def model_check(device, smoke: bool) -> list[dict]:
    rows = []
    # the CPU reference is the dequantize GEMM (torch before 2.13 has no row-wise _scaled_mm on the CPU)
    compiler.kernels.fp8_gemm.select_kernel = lambda device, grouped=False: "triton" if device.type == "cuda" else "dequant"
    for seq in (64, 200):  # 2 x 200 tokens reach Int4Linear's dequantize + cuBLAS path
        ids = torch.randint(0, 512 if smoke else 49152, (2, seq), generator=torch.Generator().manual_seed(seq))
        float_logits = smollm2_shaped(smoke)(ids)
        # fp8-shift: the shift fused into the Triton cast on CUDA; fp8-outliers: cast in torch, a bf16 side product
        for fmt in ("fp8", "fp8-shift", "fp8-outliers", "int4"):
            float_model = smollm2_shaped(smoke)
            cpu_model = convert(float_model, fmt, input_stats(float_model, ids) if fmt.startswith("fp8-") else None)
            ref = cpu_model(ids)  # torch reference paths (CPU, float32)
            row = {"format": fmt, "tokens": 2 * seq, "rel_vs_float": rel(ref, float_logits)}
            if fmt != "int4":
                row["cpu_spread_at_1e-3"] = rel(perturbed_gemms(cpu_model, ids), ref)
            row["rel_gpu_vs_cpu"] = rel(cpu_model.to(device)(ids.to(device)), ref)
            rows.append(row)
    return rows


def perturbed_gemms(model: Transformer, ids: torch.Tensor, size: float = 1e-3) -> torch.Tensor:
    """Logits with every FP8 GEMM output multiplied by (1 + size * N(0, 1)): the model's sensitivity
    to differences as small as the GPU kernel's (float32 accumulation order, Hopper's FP8 sums)."""
    import compiler.formats.fp8 as fp8

    exact = fp8.fp8_gemm
    gen = torch.Generator().manual_seed(0)
    fp8.fp8_gemm = lambda *a, **kw: (lambda y: y * (1 + size * torch.randn(y.shape, generator=gen)))(exact(*a, **kw))
    try:
        return model(ids)
    finally:
        fp8.fp8_gemm = exact


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write all results to this file")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no timings (CPU under TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not (args.smoke and os.environ.get("TRITON_INTERPRET") == "1"):
        raise SystemExit("no CUDA device: run with --smoke under TRITON_INTERPRET=1 for a CPU dry run")
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
               "torch": torch.__version__}
    start = time.time()
    parts = [("fp8_correctness", lambda: check_fp8(device, args.smoke)),
             ("w4a16_correctness", lambda: check_w4a16(device, args.smoke)),
             ("model_correctness", lambda: model_check(device, args.smoke))]
    if not args.smoke:
        parts += [("fp8_speed", lambda: speed_fp8(device)), ("w4a16_speed", lambda: speed_w4a16(device))]
    for name, run in parts:
        results[name] = attempt(run)
        print(name, json.dumps(results[name])[:3000], f"({time.time() - start:.0f} s)", flush=True)
        if name == "model_correctness":  # the correctness parts are done: check them before the timings
            results["failed_checks"] = out_of_bounds(results, device.type)
        if args.json:  # after each part: a later part that hangs keeps the earlier ones; the parts as fields, no rows
            write_result(args.json, [], **results)
    for failure in results["failed_checks"]:
        print(f"FAILED {failure}", file=sys.stderr)
    if results["failed_checks"]:
        raise SystemExit(f"{len(results['failed_checks'])} correctness check(s) out of bound (see above)")


if __name__ == "__main__":
    main()
