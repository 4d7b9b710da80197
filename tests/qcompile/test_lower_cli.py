"""``qcompile lower``: dispatch through the target registry, one-line errors, exit codes."""
from __future__ import annotations

import sys

import pytest
from onnx_helpers import make_artifact

from backends.onnx.bundle import OnnxBundleInfo


def run_cli(monkeypatch, capsys, *args) -> tuple[int, str]:
    from qcompile.cli import main

    monkeypatch.setattr(sys, "argv", ["qcompile", *map(str, args)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out + captured.err


def test_lower_onnx(tmp_path, monkeypatch, capsys):
    artifact = make_artifact(tmp_path, "qwen2", 32)
    code, out = run_cli(monkeypatch, capsys, "lower", artifact, "--target", "onnx", "-o", tmp_path / "b")
    assert code == 0 and "MatMulNBits" in out
    info = OnnxBundleInfo.read(tmp_path / "b")
    assert info.target == "onnx" and info.max_len == 256  # min(1024, the tiny model's 256)


def test_lower_vllm_prints_what_writing_a_float32_int4_model_in_float16_rounds(tmp_path, monkeypatch, capsys):
    from conftest import make_byte_tokenizer

    tokenizer = make_byte_tokenizer()
    artifact = make_artifact(tmp_path, "llama", 32, tokenizer=tokenizer, vocab_size=len(tokenizer))
    code, out = run_cli(monkeypatch, capsys, "lower", artifact, "--target", "vllm", "-o", tmp_path / "v")
    assert code == 0 and "note: written in float16, as vLLM runs INT4 layers" in " ".join(out.split())  # rich wraps


@pytest.mark.parametrize("args,match", [(("--target", "onx"), "did you mean 'onnx'"),
                                        (("--target", "ascend"), "needs --soc"),
                                        (("--target", "onnx", "--max-len", "4096"), "max_seq_len")])
def test_lower_errors_are_one_line(tmp_path, monkeypatch, capsys, args, match):
    artifact = make_artifact(tmp_path, "llama")
    code, out = run_cli(monkeypatch, capsys, "lower", artifact, *args, "-o", tmp_path / "b")
    assert code == 2 and match in out and "Traceback" not in out
    assert not (tmp_path / "b").exists()


def test_a_flag_the_target_does_not_take_names_the_target_and_its_flags(tmp_path, monkeypatch, capsys):
    code, out = run_cli(monkeypatch, capsys, "lower", tmp_path, "--target", "onnx", "--soc", "Ascend910B3", "-o", tmp_path / "y")
    assert code == 2 and "--target onnx does not take --soc; its options: --max-len" in out
    assert out.count("\n") == 1 and not (tmp_path / "y").exists()


def test_target_flags_reach_the_targets_dataclass(tmp_path, monkeypatch, capsys):
    """Comma lists and repeated flags both build a list option; only the flags given are passed."""
    from dataclasses import replace

    from backends.ascend import AscendLowerOptions
    from compiler.deploy.targets import TARGETS, LowerResult

    calls = []
    fake = replace(TARGETS["ascend"], lower=lambda *args: calls.append(args) or LowerResult(args[1]))
    monkeypatch.setitem(TARGETS, "ascend", fake)
    code, out = run_cli(monkeypatch, capsys, "lower", tmp_path, "--target", "ascend", "--soc", "Ascend910B3",
                        "--buckets", "128,256", "--buckets", "512", "-o", tmp_path / "x")
    assert code == 0, out
    assert calls == [(tmp_path, tmp_path / "x", AscendLowerOptions(soc="Ascend910B3", buckets=[128, 256, 512]), False)]
    code, out = run_cli(monkeypatch, capsys, "lower", tmp_path, "--target", "ascend", "--buckets", "128,x", "-o", tmp_path / "x")
    assert code == 2 and "--buckets '128,x': give a comma list of int values" in out


NEW_BACKEND = """
from dataclasses import dataclass
from pathlib import Path
from compiler.deploy.targets import LowerResult, Target, register_target
from compiler.options import option

@dataclass(frozen=True)
class FakeOptions:
    knob: int = option(1, "How far to turn the knob.")

def lower(artifact, out, opts, force):
    Path(out).mkdir()
    (Path(out) / "knob").write_text(str(opts.knob))
    return LowerResult(out, [f"the knob is at {opts.knob}"], {"turned": 2})

register_target(Target("fake", "a test double", lambda module, fmt: None, lower, FakeOptions))
from qcompile.cli import main
main()
"""


def test_a_new_backend_brings_its_own_flags_and_notes(tmp_path):
    """A target registered once, with its options dataclass and a lowering that returns notes, gets its
    flags and its notes printed without any change to the CLI."""
    import os
    import subprocess
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = lambda *args: subprocess.run([sys.executable, "-c", NEW_BACKEND, "lower", *map(str, args)],
                                       capture_output=True, text=True, env=env, timeout=300)
    r = run("--help")
    assert r.returncode == 0 and "--knob" in r.stdout and "fake: How far" in r.stdout
    r = run(tmp_path, "--target", "fake", "--knob", "7", "-o", tmp_path / "x")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "x" / "knob").read_text() == "7"
    assert "note: the knob is at 7" in r.stdout and "turned" in r.stdout and f"wrote {tmp_path / 'x'}" in r.stdout
    r = run(tmp_path, "--target", "onnx", "--knob", "7", "-o", tmp_path / "y")
    assert r.returncode == 2 and "--target onnx does not take --knob" in r.stderr


def test_lower_python_api_names_the_targets_options(tmp_path):
    from compiler.deploy.lowering import lower
    from compiler.errors import ConfigError

    with pytest.raises(ConfigError, match="lower target 'onnx': unknown option 'soc'"):
        lower(tmp_path, "onnx", tmp_path / "x", {"soc": "Ascend910B3"})
