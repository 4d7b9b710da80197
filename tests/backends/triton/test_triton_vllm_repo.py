"""``lower --target triton --engine vllm``: the model repository of NVIDIA's Triton vLLM backend.

The backend needs a CUDA GPU and NVIDIA's image, so the repository is checked for structure: the
configuration parsed by Triton's own protobuf schema, model.json's engine arguments (and, with the
vLLM install, that vLLM's AsyncEngineArgs takes them), the checkpoint equal to ``lower --target
vllm``'s, and the refusals.
"""
from __future__ import annotations

import filecmp
import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import make_byte_tokenizer, make_hf_model
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

import backends  # noqa: F401  (registers the triton and vllm lowerings)
import passes  # noqa: F401
from backends.triton.lower import LowerOptions
from compiler.deploy.lowering import lower
from compiler.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
VLLM = {"engine": "vllm", "device": "cuda", "name": "m"}


def _compile(checkpoint: Path, out: Path, pass_list: list[dict], dtype: str = "float32") -> Path:
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    config = {"calibration": {"samples": 4, "seq_len": 64}, "model": {"dtype": dtype}, "passes": pass_list}
    return compile_model(checkpoint, PipelineConfig.from_dict(config), out).path


# Cheap settings: the repository, not the quantization, is under test.
AWQ = [{"name": "awq", "group_size": 32, "alpha_grid": 2, "clip_search": False, "weight_rounding": "nearest"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama with the byte-level tokenizer (vLLM needs one), compiled once per module below."""
    tokenizer = make_byte_tokenizer()
    path = tmp_path_factory.mktemp("triton-vllm") / "ckpt"
    make_hf_model("llama", vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def int4(checkpoint) -> Path:
    return _compile(checkpoint, checkpoint.parent / "int4", AWQ, dtype="float16")


def _parse_config(model_dir: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def test_repository_is_the_vllm_backends(int4, tmp_path):
    model_dir = lower(int4, "triton", tmp_path / "repo", VLLM).path
    assert model_dir == tmp_path / "repo" / "m"
    assert sorted(p.name for p in model_dir.iterdir()) == ["1", "config.pbtxt"]
    config = _parse_config(model_dir)
    assert (config.name, config.backend, config.max_batch_size) == ("m", "vllm", 0)
    assert config.model_transaction_policy.decoupled  # the backend asserts it
    assert [(g.count, g.kind) for g in config.instance_group] == [(1, model_config_pb2.ModelInstanceGroup.KIND_MODEL)]
    assert not config.input and not config.output  # the backend completes them itself
    assert sorted(p.name for p in (model_dir / "1").iterdir()) == ["checkpoint", "model.json"]
    engine = json.loads((model_dir / "1" / "model.json").read_text())
    assert engine == {"model": "/models/m/1/checkpoint", "dtype": "float16", "max_model_len": 256,
                      "generation_config": "vllm"}


def test_checkpoint_is_the_vllm_targets_and_model_json_finds_it(int4, tmp_path):
    model_dir = lower(int4, "triton", tmp_path / "repo", {**VLLM, "repository_root": "/srv/triton/"}).path
    engine = json.loads((model_dir / "1" / "model.json").read_text())
    served = Path(engine["model"])
    assert served.is_absolute() and (tmp_path / "repo" / served.relative_to("/srv/triton")) == model_dir / "1" / "checkpoint"
    reference = lower(int4, "vllm", tmp_path / "vllm").path
    compared = filecmp.dircmp(reference, model_dir / "1" / "checkpoint")
    assert sorted(os.listdir(reference)) == sorted(os.listdir(model_dir / "1" / "checkpoint"))
    _, mismatch, errors = filecmp.cmpfiles(reference, model_dir / "1" / "checkpoint", compared.common_files, shallow=False)
    assert mismatch == [] and errors == []  # byte for byte: the vllm target's export, not a copy of its logic


def test_fp8_kv_cache_asks_vllm_for_an_fp8_cache(checkpoint, tmp_path):
    fp8 = [{"name": "fp8", "input_shift": False, "max_layer_error": 10.0, "kv_cache_dtype": "float8_e4m3fn",
            "kv_cache_granularity": "per_tensor"}]
    artifact = _compile(checkpoint, tmp_path / "fp8", fp8)
    engine = json.loads((lower(artifact, "triton", tmp_path / "repo", VLLM).path / "1" / "model.json").read_text())
    assert engine["kv_cache_dtype"] == "fp8_e4m3" and engine["dtype"] == "float32"


@pytest.mark.integration
def test_vllms_engine_args_take_model_json(int4, tmp_path):
    """vLLM's own AsyncEngineArgs (what the backend builds from model.json) accepts every key."""
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        pytest.fail(f"vLLM is not installed at {python}; run scripts/setup_vllm.sh")
    model_json = lower(int4, "triton", tmp_path / "repo", VLLM).path / "1" / "model.json"
    code = ("import json, sys; from vllm.engine.arg_utils import AsyncEngineArgs; "
            "a = AsyncEngineArgs(**json.load(open(sys.argv[1]))); print(a.model, a.dtype, a.max_model_len)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([str(python), "-c", code, str(model_json)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-3:] == ["/models/m/1/checkpoint", "float16", "256"]


@pytest.mark.parametrize("options, words", [
    ({"engine": "vllm"}, "add --device cuda"),
    ({"engine": "vllm", "device": "npu"}, "add --device cuda"),
    ({**VLLM, "instances": 2}, "neither instances nor max_tokens_limit"),
    ({**VLLM, "max_tokens_limit": 64}, "neither instances nor max_tokens_limit"),
    ({**VLLM, "repository_root": "models"}, "must be an absolute path"),
    ({"repository_root": "/models"}, "repository_root is for engine 'vllm'"),
    ({"engine": "tensorrt"}, "unknown engine 'tensorrt'"),
])
def test_options_that_do_not_fit_are_refused(int4, tmp_path, options, words):
    with pytest.raises(ConfigError, match=words) as e:
        lower(int4, "triton", tmp_path / "repo", options)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "repo").exists()


def test_what_vllm_cannot_run_is_refused_before_writing(checkpoint, tmp_path):
    artifact = _compile(checkpoint, tmp_path / "artifact", [{**AWQ[0], "modules_to_not_convert": []}], "float16")
    with pytest.raises(ConfigError, match="keep lm_head in modules_to_not_convert"):
        lower(artifact, "triton", tmp_path / "repo", VLLM)
    assert not (tmp_path / "repo" / "m").exists()


def test_the_python_backend_stays_the_default():
    assert LowerOptions().engine == "qcompile"
