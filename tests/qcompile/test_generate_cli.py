"""``qcompile generate`` on a tiny INT4 artifact: it streams a completion and says which kernels ran,
with the ISA level of qcompile's CPU kernels, under the default plan and a capped one."""
from __future__ import annotations

import sys

import pytest

from compiler.pipeline import PipelineConfig
from compiler.pipeline.compile import compile_model

INT4 = {"calibration": {"samples": 2, "seq_len": 32}, "passes": [{"name": "awq", "group_size": 32}]}


@pytest.fixture
def int4_artifact(tmp_path, tiny_checkpoint_with_tokenizer):
    import passes  # noqa: F401  (registers the passes)

    path, _ = tiny_checkpoint_with_tokenizer("llama")
    return compile_model(str(path), PipelineConfig.from_dict(INT4), tmp_path / "artifact", False, False).path


def generate(artifact, capsys, monkeypatch, *flags) -> str:
    from qcompile.cli import main

    monkeypatch.setattr(sys, "argv", ["qcompile", "generate", str(artifact), "def f(", "--max-tokens", "3", *flags])
    with pytest.raises(SystemExit) as exit_info:
        main()
    captured = capsys.readouterr()
    assert exit_info.value.code in (0, None), captured.err
    return captured.err


def test_generate_names_the_kernels_and_their_isa_level(int4_artifact, capsys, monkeypatch):
    from compiler.kernels.cpu_ext import cpu_isa_in_use

    level = cpu_isa_in_use()
    if level is None:
        pytest.skip("qcompile's C++ CPU kernels are not loaded here")
    err = generate(int4_artifact, capsys, monkeypatch, "--device", "cpu")
    assert "INT4: w4a8" in err  # the default plan, "auto", on a CPU that runs W4A8
    assert f"kernels: ISA {level} · linear dense_linear [{level}] · int4 decode w4a8_linear [{level}] ×8" in err  # fused q/k/v, gate/up
    err = generate(int4_artifact, capsys, monkeypatch, "--device", "cpu", "--int4-compute", "w4a16")
    assert "INT4: w4a16" in err and "int4 decode aten._weight_int4pack_mm_for_cpu ×8" in err


def test_an_unknown_isa_cap_is_one_line(int4_artifact, capsys, monkeypatch):
    from compiler.kernels import cpu_ext

    monkeypatch.setenv("QCOMPILE_CPU_ISA", "avx10")
    monkeypatch.setattr(cpu_ext._Active, "status", None)  # resolve again, under the cap
    monkeypatch.setattr(sys, "argv", ["qcompile", "generate", str(int4_artifact), "x", "--max-tokens", "1"])
    from qcompile.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "QCOMPILE_CPU_ISA='avx10' is not an ISA level; use one of avx2, avx2_vnni, avx512, avx512_vnni, avx512_bf16" in err
