"""Cross-check ``qcompile bench`` against wrk, a load tool nobody here wrote.

Both drive the same non-streaming request (Triton's HTTP ``/generate``, one JSON body) at the same
concurrency for the same duration against one real Triton server; the request latency p50 and
requests/s of the two must agree within 10%.

    python benchmarks/wrk_crosscheck.py --concurrency 1,4 --duration 15 --json out/wrk_crosscheck.json
    python benchmarks/wrk_crosscheck.py --artifact out/example/float --output-len 4   # a real model

Without ``--artifact`` it serves a tiny random Llama with a byte-level tokenizer (fast requests,
so each window holds many; the check is of the measurement, not of the model). Needs ``wrk``
(``apt-get install -y wrk``) and the Triton runtime (``python -m backends.triton.runtime``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tiny-model and byte-tokenizer helpers of the test suite

from benchmarks.common import write_result  # noqa: E402

MODEL = "crosscheck"
TOLERANCE = 0.10
LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [[{body}]]
"""


def tiny_artifact(root: Path) -> Path:
    """A tiny random Llama + byte tokenizer compiled to an artifact (as the Triton tests build)."""
    from conftest import make_byte_tokenizer, make_hf_model

    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    tok = make_byte_tokenizer()
    make_hf_model("llama", vocab_size=len(tok), max_position_embeddings=256).save_pretrained(root / "ckpt")
    tok.save_pretrained(root / "ckpt")
    return compile_model(root / "ckpt", PipelineConfig(), root / "artifact").path


def start_server(artifact: Path, root: Path):
    import backends  # noqa: F401  (registers the triton target)
    from backends.triton.runtime import (
        ServerOptions,
        TritonServer,
        free_port,
        prepare_runtime,
    )
    from compiler.deploy.lowering import lower

    prepare_runtime()
    repo = lower(artifact, "triton", root / "repo", {"name": MODEL}).path
    opts = ServerOptions(repo.parent, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    return TritonServer(opts, log_path=root / "server.log").start(timeout_s=300)


def the_request(artifact: Path, prompt_len: int, output_len: int):
    """One request of the synthetic workload: real corpus tokens, greedy, EOS ignored."""
    from compiler.io.types import load_tokenizer
    from serving.bench.workload import LengthDist, WorkloadConfig, build_requests

    config = WorkloadConfig(LengthDist("fixed", prompt_len), LengthDist("fixed", output_len))
    return build_requests(config, load_tokenizer(artifact), 1)[0]


def run_suite(url: str, request, concurrency: int, duration: float) -> dict:
    """This suite's closed loop over the one request, non-streaming, for ``duration`` seconds."""
    from serving.adapters.triton_http import TritonHttpAdapter
    from serving.bench.metrics import compute_metrics
    from serving.bench.runner import LoadConfig, run_trial

    async def go():
        adapter = TritonHttpAdapter(url, MODEL, stream=False)
        try:
            load = LoadConfig(concurrency=concurrency, num_requests=None, duration_s=duration, warmup=2 * concurrency)
            return await run_trial(adapter, [request], load, asyncio.Event())
        finally:
            await adapter.close()

    trial = asyncio.run(go())
    m = compute_metrics([trial])
    if m["counts"]["failed"]:
        first = next(r.error for r in trial.records if not r.ok)
        raise SystemExit(f"{m['counts']['failed']} requests failed in the suite's run; first: {first}")
    return {"p50_ms": m["request_latency"]["p50"], "requests_per_s": m["request_throughput"]["mean"],
            "requests": m["counts"]["requests"], "mean_ms": m["request_latency"]["mean"]}


def _ms(value: str, unit: str) -> float:
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[unit]


def run_wrk(url: str, body: str, concurrency: int, duration: float, workdir: Path) -> dict:
    """wrk with one thread and ``concurrency`` keep-alive connections, POSTing ``body``; its p50 and Requests/sec."""
    script = workdir / "post.lua"
    script.write_text(LUA.format(body=body))
    cmd = ["wrk", "-t1", f"-c{concurrency}", f"-d{int(round(duration))}s", "--timeout", "60s", "--latency", "-s", str(script),
           f"http://{url}/v2/models/{MODEL}/generate"]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return {**parse_wrk(text), "command": " ".join(cmd), "output": text}


def parse_wrk(text: str) -> dict:
    """wrk --latency's report: its latency p50 (ms), Requests/sec and request count."""
    if "Non-2xx" in text or "Socket errors" in text:
        raise SystemExit(f"wrk saw failed requests:\n{text}")
    p50 = re.search(r"^\s*50%\s+([\d.]+)(us|ms|s|m)\s*$", text, re.M)
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", text, re.M)
    total = re.search(r"(\d+) requests in", text)
    if not (p50 and rps and total):
        raise SystemExit(f"wrk's report lacks its latency p50, Requests/sec or request count:\n{text}")
    return {"p50_ms": _ms(*p50.groups()), "requests_per_s": float(rps.group(1)), "requests": int(total.group(1))}


def measure(url: str, request, body: str, concurrency: int, args, root: Path) -> dict:
    """``args.rounds`` rounds, each tool once per round and first every other round (so drift of a
    shared machine hits both alike); the figures are means over rounds."""
    suite, wrk = [], []
    for r in range(args.rounds):
        tools = [lambda: suite.append(run_suite(url, request, concurrency, args.duration)),
                 lambda: wrk.append(run_wrk(url, body, concurrency, args.duration, root))]
        for tool in tools if r % 2 == 0 else tools[::-1]:
            tool()
    mean = {tool: {k: sum(x[k] for x in runs) / len(runs) for k in ("p50_ms", "requests_per_s")}
            for tool, runs in (("suite", suite), ("wrk", wrk))}
    ratios = {k: mean["suite"][k] / mean["wrk"][k] for k in ("p50_ms", "requests_per_s")}
    row = {"concurrency": concurrency, "suite": mean["suite"], "wrk": mean["wrk"], "ratio": ratios,
           "within_10pct": all(abs(x - 1) <= TOLERANCE for x in ratios.values()),
           "rounds": {"suite": suite, "wrk": wrk}, "wrk_command": wrk[0]["command"]}
    print(f"concurrency {concurrency}: latency p50 suite {mean['suite']['p50_ms']:.2f} ms / wrk {mean['wrk']['p50_ms']:.2f} ms "
          f"(×{ratios['p50_ms']:.3f}); req/s suite {mean['suite']['requests_per_s']:.2f} / wrk {mean['wrk']['requests_per_s']:.2f} "
          f"(×{ratios['requests_per_s']:.3f}); requests {sum(x['requests'] for x in suite)} vs {sum(x['requests'] for x in wrk)}; "
          f"{'OK' if row['within_10pct'] else 'DIFFERS by more than 10%'}", flush=True)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, help="artifact to serve (default: a tiny random Llama)")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per measurement (wrk -d, suite --duration)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of each tool per concurrency")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--json", "--output", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found; install it with 'apt-get install -y wrk'")
    from serving.adapters.triton_common import request_fields

    root = Path(tempfile.mkdtemp(prefix="wrk-crosscheck-"))
    artifact = args.artifact or tiny_artifact(root)
    request = the_request(artifact, args.prompt_len, args.output_len)
    body = json.dumps(request_fields(request.prompt, request.params, stream=False))
    server = start_server(artifact, root)
    rows = []
    try:
        for c in [int(x) for x in args.concurrency.split(",")]:
            rows.append(measure(server.http_url, request, body, c, args, root))
    finally:
        server.stop()
    write_result(args.json, rows, artifact=str(args.artifact or "tiny random llama"), body=json.loads(body),
                 duration_s=args.duration)
    sys.exit(0 if all(r["within_10pct"] for r in rows) else 1)


if __name__ == "__main__":
    main()
