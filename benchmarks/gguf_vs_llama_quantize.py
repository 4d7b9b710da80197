r"""qcompile's GGUF files against llama.cpp's own quantizer on the same float model, judged by llama.cpp.

    python benchmarks/gguf_vs_llama_quantize.py                          # SmolLM2-135M, q4_0,q4_1,q4_k_m
    python benchmarks/gguf_vs_llama_quantize.py --types q4_0 --json /tmp/gguf-bench/smollm2.json
    python benchmarks/gguf_vs_llama_quantize.py --model gemma3-270m --types q4_k_m --windows 8
    python benchmarks/gguf_vs_llama_quantize.py --types q4_0 --force     # redo every step

Per model, in ``--work-dir``/MODEL (each step is skipped when its output is there, unless ``--force``):

1. the float model as F32 GGUF:
       qcompile compile MODEL -c examples/float.toml -o float.art
       qcompile lower float.art --target gguf --float-type f32 -o float-f32.gguf
2. llama.cpp's importance matrix on the windows qcompile's awq pass calibrates on (32 x 512 tokens of
   the pydoc calibration pool, seed 0: ``PassContext.calibration_windows`` of the awq pipeline's
   ``[calibration]``), detokenized into calib.txt:
       llama-imatrix -m float-f32.gguf -f calib.txt -o imatrix.gguf -c 512 --chunks 32 -t 2
   (calib.txt ends with 256 tokens more of the draw, as llama.cpp's tokenizer makes a few fewer tokens)
3. llama.cpp's files, TYPE in Q4_0, Q4_1, Q4_K_M:
       llama-quantize float-f32.gguf llama.cpp-TYPE.gguf TYPE 2
       llama-quantize --imatrix imatrix.gguf float-f32.gguf llama.cpp-imatrix-TYPE.gguf TYPE 2
4. qcompile's files:
       qcompile compile MODEL -c examples/awq_gguf_TYPE.toml -o qcompile-TYPE.art
       qcompile lower qcompile-TYPE.art --target gguf --embedding-type q8_0 -o qcompile-TYPE.gguf
   (the embedding in Q8_0 by round-to-nearest, as in llama.cpp's files; --qcompile-embedding-type, --qcompile-float-type)
5. quality by llama.cpp, per corpus (pydoc, stdlib-docs): the first ``--windows`` 512-token windows of
   the corpus's evaluation region (``calib.protocol``, the model's tokenizer) detokenized into
   eval-CORPUS.txt (plus a few tokens, so that llama.cpp's re-tokenization fills every chunk), then
       llama-perplexity -m float-f32.gguf -f eval-CORPUS.txt -c 512 --chunks N -t 2 --kl-divergence-base base-CORPUS.kld
       llama-perplexity -m Q.gguf -f eval-CORPUS.txt -c 512 --chunks N -t 2 --kl-divergence-base base-CORPUS.kld --kl-divergence
   parsed for PPL (llama.cpp's "Mean PPL(Q)", its final estimate), mean and 99.9% KLD, "Same top p".
   llama.cpp scores the second half of each 512-token chunk, its first token replaced by BOS: these
   perplexities are llama.cpp's, not ``qcompile eval``'s.
6. size in bytes, and decode ms/token through the llama_cpp binding (n_threads=2 or ``--decode-threads``,
   greedy, 64 tokens after the prompt's first, median of ``--decode-runs``). llama.cpp's threads spin at
   a barrier per graph node: on a 2-core machine other processes share, 2 threads decode at seconds per
   token; time there with ``--decode-threads 1``, or ``--decode-runs 0`` to skip the timing.

Goals, per type: qcompile's file has lower perplexity and lower mean KLD than llama.cpp+imatrix on both
corpora; at Q4_0 its mean KLD is at most half of llama.cpp+imatrix's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import Timing, write_result  # noqa: E402

TYPES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k_m": "Q4_K_M"}  # --types name -> llama-quantize's
METHODS = ("llama.cpp", "llama.cpp+imatrix", "qcompile")
CORPORA = ("pydoc", "stdlib-docs")
EVAL_LEN = 512
EVAL_MARGIN = 64  # extra tokens in eval-CORPUS.txt: re-tokenized by llama.cpp, the text still fills N chunks
CALIB_MARGIN = 256  # the same for calib.txt (16384 tokens: 0.2% fewer in llama.cpp's tokenization is 35)
DECODE_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
DECODE_TOKENS = 64
KLD_HALF_TYPE = "q4_0"  # the type whose goal is mean KLD <= half of llama.cpp+imatrix's
TOOL_TIMEOUT_S = 3600


# ---- parsing llama.cpp's output -------------------------------------------------------------
def _number(pattern: str, text: str, what: str) -> float:
    m = re.search(pattern, text, flags=re.MULTILINE)
    if m is None:
        raise ValueError(f"llama-perplexity output has no {what} (pattern {pattern!r})")
    return float(m.group(1))


def parse_perplexity(text: str) -> dict:
    """llama-perplexity's output -> ``{"ppl", "chunks"}``, and with ``--kl-divergence`` also
    ``{"kld_mean", "kld_p999", "same_top_pct"}`` (KLD in nats, same-top in %)."""
    out = {"chunks": int(_number(r"(?:calculating perplexity|computing) over (\d+) chunks", text, "chunk count"))}
    if "KL divergence statistics" in text:
        out["ppl"] = _number(r"^Mean PPL\(Q\)\s*:\s*([\d.]+)", text, "Mean PPL(Q)")
        out["kld_mean"] = _number(r"^Mean\s+KLD:\s*([\d.]+)", text, "Mean KLD")
        out["kld_p999"] = _number(r"^99\.9%\s+KLD:\s*([\d.]+)", text, "99.9% KLD")
        out["same_top_pct"] = _number(r"^Same top p:\s*([\d.]+)", text, "Same top p")
    else:
        out["ppl"] = _number(r"Final estimate: PPL = ([\d.]+)", text, "final PPL estimate")
    return out


# ---- goals ----------------------------------------------------------------------------------
def goal_checks(rows: list[dict]) -> list[dict]:
    """Per type with both a qcompile and a llama.cpp+imatrix row: ``{"type", "goal", "holds", "detail"}``
    for lower ppl and lower mean KLD on every corpus, and at Q4_0 mean KLD <= half. A figure that is
    missing (a failed row) makes its goal not hold."""
    by = {(r["type"], r["method"]): r for r in rows}
    checks = []
    for t in dict.fromkeys(r["type"] for r in rows if r["method"] == "qcompile"):
        q, ref = by.get((t, "qcompile")), by.get((t, "llama.cpp+imatrix"))
        if q is None or ref is None:
            continue

        goals = [("lower ppl than llama.cpp+imatrix", "ppl", 1.0), ("lower mean KLD than llama.cpp+imatrix", "kld_mean", 1.0)]
        if t == KLD_HALF_TYPE:
            goals.append(("mean KLD <= half of llama.cpp+imatrix's", "kld_mean", 0.5))
        for goal, key, factor in goals:
            holds, detail = True, []
            for corpus in CORPORA:
                a, b = (r.get("quality", {}).get(corpus, {}).get(key) for r in (q, ref))
                ok = a is not None and b is not None and (a <= factor * b if factor != 1.0 else a < b)
                holds &= ok
                detail.append(f"{corpus} {_fmt(a, 4)} vs {_fmt(b, 4)}{'' if factor == 1.0 else f' (x{factor} = {_fmt(b and b * factor, 4)})'}")
            checks.append({"type": t, "goal": goal, "holds": holds, "detail": "; ".join(detail)})
    return checks


# ---- steps ----------------------------------------------------------------------------------
class Steps:
    """Runs each step unless its outputs exist (and not ``force``); records each step's seconds."""

    def __init__(self, force: bool):
        self.force, self.seconds = force, {}

    def __call__(self, name: str, outputs: list[Path], fn, *args) -> bool:
        """``fn(*args)`` as step ``name``, unless every one of ``outputs`` exists."""
        if not self.force and all(p.exists() for p in outputs):
            self.seconds[name] = "reused"
            return False
        started = time.perf_counter()
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
        fn(*args)
        self.seconds[name] = round(time.perf_counter() - started, 1)
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {self.seconds[name]} s", flush=True)
        return True


def run_tool(cmd: list, log: Path) -> str:
    """Run a command, its stdout and stderr into ``log``; raise with the log's tail on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([str(c) for c in cmd], check=False, capture_output=True, text=True, cwd=ROOT, timeout=TOOL_TIMEOUT_S,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    text = proc.stdout + proc.stderr
    log.write_text(" ".join(map(str, cmd)) + "\n" + text)
    if proc.returncode:
        raise RuntimeError(f"{Path(str(cmd[0])).name} failed (exit {proc.returncode}), see {log}:\n{text[-2000:]}")
    return text


def qcompile_cli() -> Path:
    return Path(sys.executable).parent / "qcompile"


def compile_and_lower(steps: Steps, label: str, model: str, config: Path, art: Path, gguf: Path, float_type: str,
                      logs: Path, embedding_type: str = "float") -> None:
    """``qcompile compile`` (skipped when the artifact is there) and ``qcompile lower --target gguf``."""
    steps(f"{label}: qcompile compile", [art / "manifest.json"], run_tool,
          [qcompile_cli(), "compile", model, "-c", config, "-o", art, "--force"], logs / f"compile-{art.stem}.log")
    steps(f"{label}: qcompile lower", [gguf], run_tool,
          [qcompile_cli(), "lower", art, "--target", "gguf", "--float-type", float_type, "--embedding-type",
           embedding_type, "-o", gguf, "--force"],
          logs / f"lower-{gguf.stem}.log")


class Texts:
    """The calibration and evaluation texts, tokenized by the model's tokenizer (loaded once, lazily)."""

    def __init__(self, model: str):
        self.model, self._tokenizer = model, None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from compiler.io.load import load_checkpoint

            self._tokenizer = load_checkpoint(self.model).tokenizer
        return self._tokenizer

    def calibration(self, pipelines: list[Path]) -> str:
        """The awq pipelines' (one) calibration windows, as ``PassContext`` draws them, detokenized in order."""
        import torch

        from compiler.pipeline import PassContext, PipelineConfig

        config = PipelineConfig.from_toml(pipelines[0])
        if other := [p.name for p in pipelines[1:] if PipelineConfig.from_toml(p).calibration != config.calibration]:
            raise ValueError(f"{', '.join(other)} calibrate differently from {pipelines[0].name}: one imatrix cannot match both")
        context = PassContext(tokenizer=self.tokenizer, calibration=config.calibration)
        windows = context.calibration_windows()
        # llama.cpp's tokenizer makes a few fewer tokens of this text than the model's (0.2% on SmolLM2),
        # so the seeded draw's next window's first CALIB_MARGIN tokens (pool tokens too) follow, and
        # llama-imatrix --chunks SAMPLES gets every window's worth of tokens.
        more = context.calibration_windows(samples=len(windows) + 1)
        if not torch.equal(more[:-1], windows):
            raise ValueError("calibration_windows(samples + 1) does not extend the draw of samples; pad differently")
        return self.tokenizer.decode(torch.cat([windows.flatten(), more[-1, :CALIB_MARGIN]]).tolist())

    def evaluation(self, corpus: str, windows: int) -> str:
        """The first ``windows`` × 512 tokens of the corpus's evaluation region (and ``EVAL_MARGIN`` more)."""
        from calib import evaluation_windows
        from compiler.pipeline.evaluate import corpus_split

        region = corpus_split(self.tokenizer, corpus).region("evaluation")
        evaluation_windows(region, windows, EVAL_LEN)  # raises if the region is too short
        return self.tokenizer.decode(region[: windows * EVAL_LEN + EVAL_MARGIN].tolist())


def decode_ms_per_token(path: Path, runs: int, threads: int = 2) -> float:
    """Median over ``runs`` of the ms per token of a greedy generation, the first token (prefill) excluded."""
    from backends.gguf.llama_cpp import import_llama_cpp

    llama_cpp = import_llama_cpp()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    try:
        prompt = llm.tokenize(DECODE_PROMPT.encode())
        timing = Timing()
        for run in range(runs + 1):  # the first run warms up
            llm.reset()
            n, started = 0, None
            for _token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                n += 1
                if n == 1:
                    started = time.perf_counter()
                elif n == DECODE_TOKENS + 1:
                    break
            if run:
                timing.add(wall=(time.perf_counter() - started) / (n - 1))
        return timing.median_ms()
    finally:
        llm.close()


def calibration_samples(types: list[str]) -> int:
    from compiler.pipeline import PipelineConfig

    return PipelineConfig.from_toml(ROOT / "examples" / f"awq_gguf_{types[0]}.toml").calibration.samples


def write_text(path: Path, make, *args) -> None:
    path.write_text(make(*args))


def decode_timing(gguf: Path, work: Path, runs: int, threads: int, steps: Steps, label: str) -> float | None:
    """``decode_ms_per_token``, kept in logs/decode-FILE-tTHREADS.json for a rerun (None with ``runs`` 0
    and no earlier figure)."""
    cache = work / "logs" / f"decode-{gguf.stem}-t{threads}.json"
    if runs == 0:
        return json.loads(cache.read_text())["ms_per_token"] if cache.exists() else None
    steps(f"{label}: decode timing", [cache], write_text, cache,
          lambda: json.dumps({"ms_per_token": decode_ms_per_token(gguf, runs, threads)}))
    return json.loads(cache.read_text())["ms_per_token"]


# ---- the benchmark --------------------------------------------------------------------------
def quality(gguf: Path, work: Path, windows: int, steps: Steps, label: str) -> dict:
    """Per corpus, llama-perplexity's figures for ``gguf`` against the float base (its log is reused)."""
    from backends.gguf.llama_cpp import tool

    out = {}
    for corpus in CORPORA:
        log = work / "logs" / f"ppl-{gguf.stem}-{corpus}.log"
        cmd = [tool("llama-perplexity"), "-m", gguf, "-f", work / f"eval-{corpus}.txt", "-c", EVAL_LEN, "--chunks",
               windows, "-t", 2, "--kl-divergence-base", work / f"base-{corpus}.kld", "--kl-divergence"]
        steps(f"{label}: llama-perplexity {corpus}", [log], run_tool, cmd, log)
        out[corpus] = parse_perplexity(log.read_text())
        if out[corpus]["chunks"] != windows:
            raise RuntimeError(f"{log}: llama.cpp evaluated {out[corpus]['chunks']} chunks, not {windows}")
    return out


def prepare_float(args, work: Path, steps: Steps, texts: Texts) -> Path:
    """Steps 1, 2 and the float side of 5: the F32 GGUF, imatrix.gguf, eval texts and KLD bases."""
    from backends.gguf.llama_cpp import tool

    logs, float_gguf = work / "logs", work / "float-f32.gguf"
    compile_and_lower(steps, "float", args.model, ROOT / "examples" / "float.toml", work / "float.art", float_gguf,
                      "f32", logs)
    calib = work / "calib.txt"
    steps("calibration text", [calib], write_text, calib, texts.calibration,
          [ROOT / "examples" / f"awq_gguf_{t}.toml" for t in args.types])
    steps("llama-imatrix", [work / "imatrix.gguf"], run_tool,
          [tool("llama-imatrix"), "-m", float_gguf, "-f", calib, "-o", work / "imatrix.gguf", "-c", EVAL_LEN,
           "--chunks", calibration_samples(args.types), "-t", 2], logs / "imatrix.log")
    chunks = int(_number(r"computing over (\d+) chunks", (logs / "imatrix.log").read_text(), "imatrix chunk count"))
    if chunks != calibration_samples(args.types):
        raise RuntimeError(f"llama-imatrix used {chunks} chunks of calib.txt, not {calibration_samples(args.types)}")
    for corpus in CORPORA:
        text, base = work / f"eval-{corpus}.txt", work / f"base-{corpus}.kld"
        log = logs / f"ppl-float-f32-{corpus}.log"
        steps(f"eval text {corpus}", [text], write_text, text, texts.evaluation, corpus, args.windows)
        steps(f"float: llama-perplexity {corpus} (KLD base)", [base, log], run_tool,
              [tool("llama-perplexity"), "-m", float_gguf, "-f", text, "-c", EVAL_LEN, "--chunks", args.windows, "-t", 2,
               "--kl-divergence-base", base], log)
    return float_gguf


def make_file(args, work: Path, steps: Steps, t: str, method: str) -> Path:
    """Steps 3 and 4: the GGUF file of ``method`` at type ``t``."""
    from backends.gguf.llama_cpp import tool

    logs, float_gguf = work / "logs", work / "float-f32.gguf"
    if method == "qcompile":
        gguf = work / f"qcompile-{t}.gguf"
        compile_and_lower(steps, f"{t} qcompile", args.model, ROOT / "examples" / f"awq_gguf_{t}.toml",
                          work / f"qcompile-{t}.art", gguf, args.qcompile_float_type, logs, args.qcompile_embedding_type)
        return gguf
    imatrix = method == "llama.cpp+imatrix"
    gguf = work / f"llama.cpp{'-imatrix' if imatrix else ''}-{t}.gguf"
    flags = ["--imatrix", work / "imatrix.gguf"] if imatrix else []
    steps(f"{t} {method}: llama-quantize", [gguf], run_tool,
          [tool("llama-quantize"), *flags, float_gguf, gguf, TYPES[t], 2], logs / f"quantize-{gguf.stem}.log")
    return gguf


def measure(args, work: Path, steps: Steps, gguf: Path, label: str) -> dict:
    """Quality, size and decode speed of one file; a failure becomes the row's ``error``."""
    row = {"file": str(gguf), "size_bytes": gguf.stat().st_size}
    try:
        row["quality"] = quality(gguf, work, args.windows, steps, label)
        row["ms_per_token"] = decode_timing(gguf, work, args.decode_runs, args.decode_threads, steps, label)
    except Exception as e:  # noqa: BLE001 - a file llama.cpp cannot run is a row with its error
        row["error"] = f"{type(e).__name__}: {e}"
        print(f"{label}: {row['error']}", flush=True)
    return row


def float_row(args, work: Path, float_gguf: Path, steps: Steps) -> dict:
    row = {"model": args.model, "type": "f32", "method": "float", "file": str(float_gguf),
           "size_bytes": float_gguf.stat().st_size,
           "quality": {c: parse_perplexity((work / "logs" / f"ppl-float-f32-{c}.log").read_text()) for c in CORPORA}}
    row["ms_per_token"] = decode_timing(float_gguf, work, args.decode_runs, args.decode_threads, steps, "float")
    return row


def _fmt(x, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(rows: list[dict], decode_threads: int = 2) -> str:
    def per_corpus(r, key, digits):
        return [_fmt(r.get("quality", {}).get(c, {}).get(key), digits) for c in CORPORA]

    head = ["model", "type", "method", "size MB"] + [f"ppl {c}" for c in CORPORA] + [f"mean KLD {c}" for c in CORPORA] \
        + [f"p99.9 KLD {c}" for c in CORPORA] + [f"same top % {c}" for c in CORPORA] + [f"ms/token ({decode_threads} threads)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], r["type"], r["method"], f"{r['size_bytes'] / 1e6:.1f}", *per_corpus(r, "ppl", 3),
                 *per_corpus(r, "kld_mean", 4), *per_corpus(r, "kld_p999", 3), *per_corpus(r, "same_top_pct", 2),
                 _fmt(r.get("ms_per_token"), 2)]
        lines.append("| " + " | ".join(cells) + " |" + (f" ERROR: {r['error']}" if "error" in r else ""))
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a built-in model (smollm2, gemma3-270m) or a checkpoint path")
    ap.add_argument("--types", default="q4_0,q4_1,q4_k_m", help=f"comma-separated, of {', '.join(TYPES)}")
    ap.add_argument("--windows", type=int, default=8, help="512-token evaluation windows per corpus")
    ap.add_argument("--decode-runs", type=int, default=5, help="timed generations per file (median); 0: no timing (an earlier one is still shown)")
    ap.add_argument("--decode-threads", type=int, default=2, help="llama.cpp threads of the decode timing")
    ap.add_argument("--qcompile-float-type", default="auto", choices=("auto", "f32", "f16", "bf16"),
                    help="lower --float-type of qcompile's files (their float layers)")
    ap.add_argument("--qcompile-embedding-type", default="q8_0", choices=("float", "q8_0"),
                    help="lower --embedding-type of qcompile's files: q8_0, as llama.cpp's own Q4 files store the "
                         "(tied) embedding, so that the sizes compare")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/gguf-bench"))
    ap.add_argument("--json", type=Path, help="also write the rows, goals and step times here")
    ap.add_argument("--force", action="store_true", help="redo every step, even where its output exists")
    args = ap.parse_args(argv)
    args.types = args.types.split(",")
    if unknown := [t for t in args.types if t not in TYPES]:
        ap.error(f"unknown types {unknown}; use {', '.join(TYPES)}")
    work = args.work_dir / Path(args.model).name
    (work / "logs").mkdir(parents=True, exist_ok=True)
    steps, texts = Steps(args.force), Texts(args.model)

    float_gguf = prepare_float(args, work, steps, texts)
    rows = [float_row(args, work, float_gguf, steps)]
    for t in args.types:
        for method in METHODS:
            label = f"{t} {method}"
            try:
                gguf = make_file(args, work, steps, t, method)
            except Exception as e:  # noqa: BLE001 - a method that cannot make its file is a row with its error
                rows.append({"model": args.model, "type": t, "method": method, "size_bytes": 0,
                             "error": f"{type(e).__name__}: {e}"})
                print(f"{label}: {rows[-1]['error']}", flush=True)
                continue
            rows.append({"model": args.model, "type": t, "method": method, **measure(args, work, steps, gguf, label)})
            print(json.dumps(rows[-1]), flush=True)

    goals = goal_checks(rows)
    print()
    print(table(rows, args.decode_threads))
    print()
    for g in goals:
        print(f"{g['type']}: {g['goal']}: {'HOLDS' if g['holds'] else 'does NOT hold'} ({g['detail']})")
    print("\nstep seconds:", json.dumps(steps.seconds, indent=1))
    return write_result(args.json, rows, model=args.model, windows=args.windows, decode_threads=args.decode_threads,
                        goals=goals, step_seconds=steps.seconds)


if __name__ == "__main__":
    main()
