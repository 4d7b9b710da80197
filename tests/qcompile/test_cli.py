"""The command line as a user meets it: real processes, exit codes, one-line errors."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest


def qcompile(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "qcompile", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


@pytest.fixture
def tiny_artifact(tiny_checkpoint_with_tokenizer, tmp_path):
    src, _ = tiny_checkpoint_with_tokenizer("llama")
    (tmp_path / "float.toml").write_text('[calibration]\nsamples = 4\nseq_len = 32\n')
    r = qcompile("compile", src, "-c", tmp_path / "float.toml", "-o", tmp_path / "art")
    assert r.returncode == 0, r.stderr
    return src, tmp_path / "art"


def test_compile_inspect_eval(tiny_artifact):
    src, art = tiny_artifact
    r = qcompile("inspect", art, "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["formats"] == {"float32": 16} and summary["size"]["weights_bytes"] > 0
    assert all(layer["bits_per_weight"] == 32 for layer in summary["layers"])
    assert "layers" in qcompile("inspect", art).stdout
    results = []
    for path in (src, art):
        r = qcompile("eval", path, "--windows", "2", "--json")
        assert r.returncode == 0, r.stderr
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert results[0] == results[1] and results[0]["tokens"] == 2 * 511


@pytest.mark.parametrize("toml, message", [
    ('[[passes]]\nname = "awk"\n', "passes[0]: unknown pass 'awk'"),
    ('[calibration]\nsampels = 3\n', "[calibration]: unknown option 'sampels'; did you mean 'samples'?"),
    ('[model\n', "not valid TOML"),
])
def test_bad_pipeline_is_one_line(tiny_checkpoint, tmp_path, toml, message):
    src, _ = tiny_checkpoint("llama")
    (tmp_path / "p.toml").write_text(toml)
    r = qcompile("compile", src, "-c", tmp_path / "p.toml", "-o", tmp_path / "out")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: {r.stderr.strip().removeprefix('error: ')}"]
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_debug_shows_traceback(tmp_path):
    r = qcompile("--debug", "eval", tmp_path / "missing")
    assert r.returncode != 0 and "Traceback" in r.stderr and "CheckpointError" in r.stderr


def test_bad_inputs_exit_nonzero(tmp_path):
    r = qcompile("eval", tmp_path / "missing")
    assert r.returncode == 2 and "no such file or directory" in r.stderr and "Traceback" not in r.stderr
    r = qcompile("inspect", tmp_path)
    assert r.returncode == 2 and "not a qcompile artifact" in r.stderr
    r = qcompile("eval", "x", "--windows", "0")
    assert r.returncode == 2  # click's own usage error


def test_eval_against_a_reference(tiny_checkpoint_with_tokenizer, tmp_path):
    """llama.cpp's KL-divergence table against a model, its reference file reused, --json and --plot."""
    reference, _ = tiny_checkpoint_with_tokenizer("llama")
    candidate, _ = tiny_checkpoint_with_tokenizer("mistral")  # the same tokenizer, other weights
    ref_file, png = tmp_path / "ref.kld", tmp_path / "kld.png"
    r = qcompile("eval", candidate, "--reference", reference, "--windows", "2", "--save-reference", ref_file, "--plot", png)
    assert r.returncode == 0, r.stderr
    rows = {line.split("│")[1].strip(): line for line in r.stdout.splitlines() if line.count("│") == 4}
    for label in ("Mean PPL(Q)", "Mean PPL(base)", "Cor(ln(PPL(Q)), ln(PPL(base)))", "Mean ln(PPL(Q)/PPL(base))",
                  "Mean KLD", "99.9% KLD", "Median KLD", "Minimum KLD", "RMS Δp", "Same top p"):
        assert label in rows, label  # whole rows, though stdout is no terminal
    assert rows["Mean KLD"].split("│")[3].strip() and rows["Same top p"].rstrip("│ ").endswith("%")  # ± given
    assert f"wrote {ref_file}" in r.stdout and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    r = qcompile("eval", candidate, "--reference", ref_file, "--windows", "2", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert {"ppl", "ppl_base", "ln_ppl_ratio", "ln_ppl_ratio_uncertainty", "kld_mean", "kld_mean_uncertainty",
            "kld_median", "kld_90", "kld_95", "kld_99", "kld_99_9", "kld_max", "kld_min", "rms_dp",
            "rms_dp_uncertainty", "same_top", "same_top_uncertainty"} <= set(result)
    assert result["tokens"] == 2 * 511 and result["windows"] == 2 and result["reference"] == str(ref_file)
    assert result["kld_mean"] > 0 and 0 <= result["same_top"] <= 1


def test_eval_reference_bad_inputs(tiny_checkpoint_with_tokenizer, tmp_path):
    model, _ = tiny_checkpoint_with_tokenizer("llama")
    ref_file = tmp_path / "ref.kld"
    assert qcompile("eval", model, "--reference", model, "--windows", "1", "--save-reference", ref_file).returncode == 0
    for args, message in [
        (["--plot", tmp_path / "kld.png"], "--plot needs a reference to compare with"),
        (["--reference", ref_file, "--save-reference", tmp_path / "again.kld"], "is already a reference file"),
        (["--reference", ref_file, "--windows", "2"], "pass --windows 1"),
    ]:
        r = qcompile("eval", model, *args)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.slow
def test_smollm2_perplexity_protocol():
    """The issue's figure: transformers' own forward gives 11.327 on pydoc, 16 windows."""
    r = qcompile("eval", "smollm2", "--windows", "16", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["tokens"] == 16 * 511
    assert abs(result["ppl"] - 11.327) < 0.01


class NeverReadyServer:
    """Test double for a server child (tritonserver, vllm serve): it starts a process, then waits for
    a readiness that never comes, as vLLM does for minutes on a CPU."""

    def __init__(self):
        self.process = None

    def start(self):
        self.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()  # a container's stop
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(0.1)
        raise TimeoutError("SIGTERM did not interrupt the start-up wait")

    def stop(self):
        self.process.terminate()
        return self.process.wait(10)


def test_sigterm_during_a_servers_start_up_stops_it_at_once():
    from qcompile.cli.serve import _run_until_stopped

    server, before = NeverReadyServer(), signal.getsignal(signal.SIGTERM)
    start = time.monotonic()
    _run_until_stopped(server, lambda: pytest.fail("the server never gets ready"), "test server")
    assert time.monotonic() - start < 5 and server.process.poll() is not None
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back
