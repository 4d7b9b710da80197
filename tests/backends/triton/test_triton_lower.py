"""Lowering to a Triton model repository, the triton target's constraints, and the server command line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from artifact_helpers import rewrite_manifest

import backends  # noqa: F401  (registers the triton target and lowering)
from backends.triton.lower import (
    LowerOptions,
    config_pbtxt,
    lower_triton,
    precision_and_kernels,
)
from backends.triton.runtime import (
    ServerOptions,
    TritonInstall,
    server_command,
    server_env,
)
from compiler.deploy.lowering import lower
from compiler.deploy.targets import check_formats
from compiler.errors import ArtifactError, ConfigError

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def artifact(tmp_path, tiny_checkpoint_with_tokenizer):
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    path, _ = tiny_checkpoint_with_tokenizer("llama")
    return compile_model(path, PipelineConfig(), tmp_path / "artifact").path


def test_repository_layout_and_config(artifact, tmp_path):
    model_dir = lower(artifact, "triton", tmp_path / "repo", {"name": "m"}).path
    assert model_dir == tmp_path / "repo" / "m"
    config = (model_dir / "config.pbtxt").read_text()
    for needle in ('backend: "python"', "decoupled: true", "kind: KIND_CPU", 'name: "text_input"', 'name: "max_tokens"',
                   'name: "stream"', 'name: "text_output"', 'name: "token_ids"', 'key: "artifact"', 'key: "precision"',
                   'key: "kernels"', "max_batch_size: 0"):
        assert needle in config, needle
    entry = (model_dir / "1" / "model.py").read_text()
    assert "from serving.triton_backend import TritonPythonModel" in entry  # the model lives in serving/
    compile(entry, "model.py", "exec")
    manifest = json.loads((model_dir / "1" / "artifact" / "manifest.json").read_text())
    assert manifest == json.loads((artifact / "manifest.json").read_text())


def test_cuda_lowering_asks_for_gpu_and_records_kernels(artifact, tmp_path):
    from dataclasses import replace

    from compiler.io.artifact import read_manifest

    record = read_manifest(artifact)
    text = config_pbtxt("m", LowerOptions(device="cuda"), record, "artifact")
    assert "kind: KIND_GPU" in text and "paged_attention_decode" in text
    assert "kind: KIND_MODEL" in config_pbtxt("m", LowerOptions(device="npu"), record, "artifact")
    record = replace(record, modules={"layers.0.mlp.up_proj": {"format": "int4", "group_size": 128}})
    precision, kernels = precision_and_kernels(record, "cuda")
    assert precision == "float32+int4" and "w4a16_int4_gemm" in kernels


def test_models_share_a_repository_and_replacing_one_needs_force(artifact, tmp_path):
    lower(artifact, "triton", tmp_path / "repo", {"name": "a"})
    lower(artifact, "triton", tmp_path / "repo", {"name": "b"})
    with pytest.raises(ArtifactError, match="already exists"):
        lower(artifact, "triton", tmp_path / "repo", {"name": "a"})
    lower(artifact, "triton", tmp_path / "repo", {"name": "a"}, force=True)
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["a", "b"]


@pytest.mark.parametrize("fmt, ok", [({"format": "int4", "group_size": 64}, True), ({"format": "int4", "group_size": 48}, False),
                                     ({"format": "int4", "group_size": 256}, True), ({"format": "fp8", "weight_dtype": "float8_e4m3fn"}, True),
                                     ({"format": "nf4"}, False)])
def test_target_constraints(fmt, ok):
    if ok:
        check_formats("triton", {"layers.0.mlp.up_proj": fmt})
    else:
        with pytest.raises(ConfigError, match="cannot run"):
            check_formats("triton", {"layers.0.mlp.up_proj": fmt})


def test_lowering_refuses_formats_the_target_cannot_run(artifact, tmp_path):
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["modules"] = {"layers.0.mlp.up_proj": {"format": "int4", "group_size": 48}}
    rewrite_manifest(artifact, manifest)
    with pytest.raises(ConfigError, match="group size 48"):
        lower_triton(artifact, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("options, match", [({"device": "gpu"}, "unknown device"), ({"name": "a b"}, "model name"),
                                            ({"instances": 0}, "instances"), ({"colour": 1}, "unknown option")])
def test_bad_lower_options(artifact, tmp_path, options, match):
    with pytest.raises(ConfigError, match=match):
        lower(artifact, "triton", tmp_path / "repo", options)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from qcompile.cli import main; main()", *args], capture_output=True,
                          text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)


def test_cli_errors_are_one_line(artifact, tmp_path):
    for args, needle in [(["lower", str(artifact), "--target", "tritn", "-o", str(tmp_path / "r")], "did you mean 'triton'"),
                         (["lower", str(tmp_path), "--target", "triton", "-o", str(tmp_path / "r")], "not a qcompile artifact"),
                         (["serve", str(tmp_path)], "no <model>/config.pbtxt")]:
        result = _cli(*args)
        assert result.returncode == 2, result.stderr
        assert needle in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_server_binds_loopback_and_sees_numpy_1(tmp_path):
    install = TritonInstall(Path("/x/bin/tritonserver"), Path("/rt/backends"), Path("/x/libs"), Path("/rt/venv/bin"), False)
    cmd = server_command(install, ServerOptions(tmp_path, http_port=1, grpc_port=2, metrics_port=3))
    for flag in ("--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
                 "--backend-directory=/rt/backends"):
        assert flag in cmd
    env = server_env(install)
    assert env["PATH"].startswith("/rt/venv/bin:") and "/x/libs" in env["LD_LIBRARY_PATH"]
    assert str(ROOT) in env["QCOMPILE_PYTHONPATH"].split(":")


def test_prepared_server_venv_has_numpy_1_and_the_project_env():
    """The server-side Python (stubs) gets numpy 1.26 first and this environment's packages after it."""
    from backends.triton.runtime import prepare_runtime

    home = prepare_runtime()
    out = subprocess.run([str(home / "venv" / "bin" / "python"), "-c", "import numpy, torch; print(numpy.__version__)"],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    assert out.strip().startswith("1.26")


def test_a_w4a8_plan_lowers_for_the_cpu_only(artifact, tmp_path):
    """int4_compute "w4a8" is a CPU kernel of the engine: a GPU repository would not run it, so it is refused."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["serving"] = {**manifest.get("serving", {}), "int4_compute": "w4a8"}
    rewrite_manifest(artifact, manifest)
    with pytest.raises(ConfigError, match="int4_compute .w4a8.*--device cpu"):
        lower(artifact, "triton", tmp_path / "repo", {"name": "m", "device": "cuda"})
    assert not (tmp_path / "repo" / "m").exists()
    assert lower(artifact, "triton", tmp_path / "repo", {"name": "m"}).path.is_dir()
