"""Workloads, result files and the ``qcompile bench`` command line (driven through test-double adapters)."""
from __future__ import annotations

import json
import random
import sys

import pytest
from bench_doubles import SleepingAdapter

from calib import load_corpus_text
from serving.bench.errors import BenchError
from serving.bench.workload import LengthDist, WorkloadConfig, build_requests


def _cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    from qcompile.cli import main

    monkeypatch.setattr(sys, "argv", ["qcompile", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    captured = capsys.readouterr()
    return exit_info.value.code or 0, captured.out, captured.err


@pytest.mark.parametrize("spec, kind, a, b", [("32", "fixed", 32, 0), ("fixed:8", "fixed", 8, 0),
                                               ("uniform:4:9", "uniform", 4, 9), ("normal:20:5", "normal", 20, 5)])
def test_length_specs_parse(spec, kind, a, b):
    assert LengthDist.parse(spec, "--prompt-len") == LengthDist(kind, a, b)


@pytest.mark.parametrize("spec", ["0", "uniform:9:4", "gauss:1:2", "x", "normal:5:-1"])
def test_bad_length_spec_is_a_one_line_error(spec):
    with pytest.raises(BenchError, match="--prompt-len"):
        LengthDist.parse(spec, "--prompt-len")


def test_synthetic_prompts_are_real_corpus_text_of_exact_length(byte_tokenizer):
    config = WorkloadConfig(LengthDist("uniform", 20, 40), LengthDist("fixed", 7), seed=3)
    requests = build_requests(config, byte_tokenizer, 16)
    corpus = load_corpus_text("pydoc")
    assert len({tuple(r.prompt) for r in requests}) == 16
    for r in requests:
        assert 20 <= len(r.prompt) <= 40 and r.input_tokens == len(r.prompt)
        assert r.params.max_tokens == 7 and r.params.ignore_eos and r.params.temperature == 0
        assert byte_tokenizer.decode(r.prompt) in corpus
    assert build_requests(config, byte_tokenizer, 16) == requests  # seeded


def test_shared_prefix_workload(byte_tokenizer):
    config = WorkloadConfig(LengthDist("fixed", 10), LengthDist("fixed", 4), shared_prefix=24)
    requests = build_requests(config, byte_tokenizer, 5)
    assert all(len(r.prompt) == 34 and r.prompt[:24] == requests[0].prompt[:24] for r in requests)
    assert len({tuple(r.prompt[24:]) for r in requests}) == 5


def test_prompts_file_workload(tmp_path, byte_tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "def f(x):", "output_len": 5}\n\n{"prompt": "The for statement"}\n')
    requests = build_requests(WorkloadConfig(output_len=LengthDist("fixed", 9), prompts_file=path), byte_tokenizer, 3)
    assert [r.params.max_tokens for r in requests] == [5, 9, 5]
    assert byte_tokenizer.decode(requests[1].prompt) == "The for statement"
    path.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(BenchError, match=r"prompts.jsonl:1: expected a JSON object"):
        build_requests(WorkloadConfig(prompts_file=path), byte_tokenizer, 1)


def test_normal_lengths_follow_the_distribution():
    rng = random.Random(0)
    samples = [LengthDist("normal", 100, 10).sample(rng) for _ in range(4000)]
    assert abs(sum(samples) / len(samples) - 100) < 1.0 and min(samples) >= 1


@pytest.fixture
def fake_target(tmp_path, byte_tokenizer, monkeypatch):
    """An artifact-like directory (manifest + tokenizer) whose adapter is swapped for a test double."""
    target = tmp_path / "artifact"
    target.mkdir()
    (target / "manifest.json").write_text('{"schema_version": 1}')
    byte_tokenizer.save_pretrained(target)
    import serving.bench.targets as bench_targets

    doubles = []

    def open_double(t, stream=True, engine_plan=None):
        doubles.append(SleepingAdapter(0.002))
        doubles[-1].engine_plan = engine_plan
        return doubles[-1]

    monkeypatch.setattr(bench_targets, "open_adapter", open_double)
    return target, doubles


def test_int4_compute_reaches_the_engine_and_the_result(fake_target, tmp_path, monkeypatch, capsys):
    target, doubles = fake_target
    code, _, stderr = _cli(monkeypatch, capsys, "bench", str(target), "--num-requests", "2", "--prompt-len", "8",
                           "--output-len", "2", "--warmup", "0", "--int4-compute", "w4a8",
                           "--output-json", str(tmp_path / "r.json"))
    assert code == 0, stderr
    assert doubles[0].engine_plan == {"int4_compute": "w4a8"}
    assert json.loads((tmp_path / "r.json").read_text())["workload"]["engine_plan"] == {"int4_compute": "w4a8"}


def test_bench_cli_writes_json_csv_markdown_plots(fake_target, tmp_path, monkeypatch, capsys):
    target, doubles = fake_target
    out = tmp_path / "res"
    code, stdout, stderr = _cli(monkeypatch, capsys, "bench", str(target), "--concurrency", "1,2", "--num-requests", "6",
                                "--prompt-len", "16", "--output-len", "5", "--warmup", "1", "--goodput", "ttft:1000",
                                "--output-json", str(out / "r.json"), "--output-csv", str(out / "r.csv"),
                                "--output-md", str(out / "r.md"), "--plots", str(out / "plots"))
    assert code == 0, stderr
    result = json.loads((out / "r.json").read_text())
    assert result["schema"] == "qcompile.bench" and result["schema_version"] == 1
    assert result["adapter"] == "sleeping-test-double" and result["environment"]["artifact_manifest_sha256"]
    assert [r["load"]["concurrency"] for r in result["runs"]] == [1, 2]
    for run in result["runs"]:
        counts = run["metrics"]["counts"]
        assert counts["requests"] == 6 and counts["output_tokens"] == 30 and counts["output_length_mismatch"] == 0
        for name in ("time_to_first_token", "inter_token_latency", "time_per_output_token", "request_latency",
                     "output_token_throughput", "request_throughput", "goodput"):
            assert set(run["metrics"][name]) >= {"mean", "std", "p50", "p90", "p95", "p99"}
    assert doubles[0].max_inflight == 2 and len(doubles[0].starts) == 14
    assert (out / "r.csv").read_text().splitlines()[0].startswith("label,mode,concurrency")
    assert "| concurrency 2 |" in (out / "r.md").read_text()
    for name in ("latency_vs_throughput.png", "ttft_distribution.png", "itl_distribution.png"):
        assert (out / "plots" / name).read_bytes()[:4] == b"\x89PNG"


def test_bench_json_prints_the_result_document_on_stdout(fake_target, tmp_path, monkeypatch, capsys):
    """--json: the result on stdout instead of the table; files and notes still written, notes on stderr."""
    target, _ = fake_target
    code, stdout, stderr = _cli(monkeypatch, capsys, "bench", str(target), "--concurrency", "1", "--concurrency", "2",
                                "--num-requests", "3", "--prompt-len", "8", "--output-len", "3", "--warmup", "0",
                                "--json", "--output-json", str(tmp_path / "r.json"), "--output-csv", str(tmp_path / "r.csv"))
    assert code == 0, stderr
    result = json.loads(stdout)
    assert result["schema"] == "qcompile.bench" and [r["load"]["concurrency"] for r in result["runs"]] == [1, 2]
    assert result == json.loads((tmp_path / "r.json").read_text())
    assert f"wrote {tmp_path / 'r.csv'}" in stderr and (tmp_path / "r.csv").exists()


def test_bench_compare_flags_regression_and_exit_code(fake_target, tmp_path, monkeypatch, capsys):
    target, _ = fake_target
    base = ["bench", str(target), "--num-requests", "4", "--prompt-len", "8", "--output-len", "4", "--warmup", "0"]
    assert _cli(monkeypatch, capsys, *base, "--output-json", str(tmp_path / "a.json"))[0] == 0
    slow = json.loads((tmp_path / "a.json").read_text())
    for stats in slow["runs"][0]["metrics"]["request_latency"], slow["runs"][0]["metrics"]["time_to_first_token"]:
        for key in ("p50", "p99"):
            stats[key] *= 1.5
    (tmp_path / "b.json").write_text(json.dumps(slow))
    code, stdout, _ = _cli(monkeypatch, capsys, "bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "a.json"))
    assert code == 0 and "regression" not in stdout
    code, stdout, _ = _cli(monkeypatch, capsys, "bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert code == 0 and "regression" in stdout
    code, _, stderr = _cli(monkeypatch, capsys, "bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                           "--fail-on-regression")
    assert code == 3 and "regressed beyond the noise band" in stderr and "Traceback" not in stderr


@pytest.mark.parametrize("args, message", [
    (["bench", "triton-grpc://localhost/m"], "triton-grpc://HOST:PORT/MODEL"),
    (["bench", "/nonexistent-dir"], "neither a directory"),
    (["bench", "compare", "/nope.json", "/nope.json"], "not found"),
    (["bench", "triton-grpc://localhost:1/m", "--no-stream"], "--no-stream applies to triton-http"),
])
def test_bench_bad_input_is_one_line(monkeypatch, capsys, args, message):
    code, _, stderr = _cli(monkeypatch, capsys, *args)
    assert code == 2 and message in stderr and "Traceback" not in stderr


def test_open_loop_rejects_concurrency_list(fake_target, monkeypatch, capsys):
    target, _ = fake_target
    code, _, stderr = _cli(monkeypatch, capsys, "bench", str(target), "--request-rate", "5", "--concurrency", "1,2")
    assert code == 2 and "--concurrency is one number" in stderr


def test_targets_are_classified_by_scheme_or_contents(tmp_path):
    from serving.bench.targets import parse_target

    grpc = parse_target("triton-grpc://127.0.0.1:8001/smol")
    assert (grpc.kind, grpc.url, grpc.model) == ("triton-grpc", "127.0.0.1:8001", "smol")
    assert parse_target("triton-http://localhost:8000/m").kind == "triton-http"
    for name, marker, kind in (("art", "manifest.json", "engine"), ("onnx", "prefill.onnx", "onnx"),
                               ("ascend", "build_om.sh", "ascend")):
        (tmp_path / name).mkdir()
        (tmp_path / name / marker).write_text("")
        assert parse_target(str(tmp_path / name)).kind == kind
    (tmp_path / "empty").mkdir()
    with pytest.raises(BenchError, match="holds no manifest.json"):
        parse_target(str(tmp_path / "empty"))


def test_missing_adapter_is_a_clear_error(tmp_path):
    from serving.bench.targets import _import

    with pytest.raises(BenchError, match="adapter .*not available in this build"):
        _import("serving.adapters.no_such_backend", "Adapter", "No-such")


def test_ctrl_c_stops_cleanly_and_writes_what_was_measured(fake_target, tmp_path):
    """A real SIGINT to a real ``qcompile bench`` process (adapter swapped for a test double in that process)."""
    import os
    import signal
    import subprocess
    import time
    from pathlib import Path

    target, _ = fake_target
    out = tmp_path / "partial.json"
    tests_dir = Path(__file__).resolve().parents[1]
    script = ("import sys; sys.path.insert(0, %r)\n"
              "import serving.bench.targets as t; from bench_doubles import SleepingAdapter\n"
              "t.open_adapter = lambda target, stream=True, engine_plan=None: (open(%r, 'w').close(), SleepingAdapter(0.05))[1]\n"
              "from qcompile.cli import main; main()" % (str(tests_dir), str(tmp_path / "started")))
    env = {**os.environ, "PYTHONPATH": f"{tests_dir.parent}:{os.environ.get('PYTHONPATH', '')}", "QCOMPILE_PROGRESS": "0"}
    proc = subprocess.Popen([sys.executable, "-c", script, "bench", str(target), "--num-requests", "1000", "--warmup", "0",
                             "--prompt-len", "8", "--output-len", "4", "--concurrency", "2", "--output-json", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "started").exists():  # imports and the workload take a while on a busy machine
        if proc.poll() is not None or time.monotonic() >= deadline:
            proc.kill()
            pytest.fail(f"bench did not start in time: {proc.communicate(timeout=60)}")
        time.sleep(0.2)
    time.sleep(2)  # requests of ~0.2 s each
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "interrupted" in stdout and "Traceback" not in stderr
    result = json.loads(out.read_text())
    counts = result["runs"][0]["metrics"]["counts"]
    assert result["interrupted"] and 0 < counts["successful"] < 1000 and counts["failed"] == 0
