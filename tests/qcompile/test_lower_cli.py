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


@pytest.mark.parametrize("args,match", [(("--target", "onx"), "did you mean 'onnx'"),
                                        (("--target", "ascend"), "needs --soc"),
                                        (("--target", "onnx", "--max-len", "4096"), "max_seq_len")])
def test_lower_errors_are_one_line(tmp_path, monkeypatch, capsys, args, match):
    artifact = make_artifact(tmp_path, "llama")
    code, out = run_cli(monkeypatch, capsys, "lower", artifact, *args, "-o", tmp_path / "b")
    assert code == 2 and match in out and "Traceback" not in out
    assert not (tmp_path / "b").exists()


def test_register_lowering_adds_a_target(monkeypatch, capsys, tmp_path):
    from compiler.deploy import lowering

    calls = []
    monkeypatch.setitem(lowering.LOWERINGS, "fake", lambda *args: calls.append(args) or args[1])
    code, _ = run_cli(monkeypatch, capsys, "lower", tmp_path, "--target", "fake", "-o", tmp_path / "x")
    assert code == 0 and calls[0] == (tmp_path, tmp_path / "x", {}, False)
    code, out = run_cli(monkeypatch, capsys, "lower", tmp_path, "--target", "onnx", "--soc", "Ascend910B3", "-o", tmp_path / "y")
    assert code == 2 and "--target onnx: unknown option 'soc'" in out
