"""The architectures beyond the Llama family on the real vLLM (the CPU wheel in .venv-vllm).

Tiny random Qwen3, Gemma 3, Qwen3-MoE and Mixtral checkpoints (``tests/arch_helpers.py``, with
vLLM-friendly heads of 32) are compiled in float and, where vLLM's CPU build runs them for that
architecture, as INT4 and FP8; lowered with ``--target vllm`` and served by vLLM one at a time.
Its greedy tokens are compared with qcompile's engine and its prompt log-probabilities with the
artifact's own math (``vllm_helpers.compare_with_engine``). What vLLM's CPU build does not run
is refused by the export, tested in test_vllm_export.py; its INT4 MoE kernel needs AMX, and on a
CPU without it the INT4 MoE checkpoints are checked to reach that kernel choice and fail there
only. Where vLLM's build on this host has no W4A16 kernel (its AVX2 build), the dense INT4
checkpoint is checked to reach vLLM's CPU W4A16 kernel and fail there only, and compressed-tensors'
decompressor to give back the artifact's weights. Not skipped without vLLM.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from arch_helpers import make_arch_model
from conftest import make_byte_tokenizer
from vllm_helpers import (FP8, INT4, VLLM_PYTHON, assert_decompresses_to_the_artifact, assert_vllm_fails_to_start,
                          assert_vllm_refuses_int4, compare_with_engine, compile_for, start_server, tiny_server, vllm_here)

from compiler.deploy.lowering import lower

pytestmark = pytest.mark.integration

# head_dim 32 (vLLM's CPU attention takes 32, 64, 80, ...), one KV head for two query heads.
SHAPE = dict(head_dim=32, num_attention_heads=2, num_key_value_heads=1)
# Cases of arch_helpers.ARCH_CASES with overrides of their own: experts of widths vLLM's CPU INT4 MoE
# kernel takes with group 64 (gate/up read 64 features, down 64 or 128), and a dense layer among them.
OWN_CASES = {"qwen3-moe-64-dense-layer-1": ("qwen3-moe", {"moe_intermediate_size": 64, "mlp_only_layers": [1]}),
             "mixtral-sliding-128": ("mixtral-sliding", {"intermediate_size": 128})}
FLOAT = {"passes": []}  # float32
# vLLM's CPU INT4 MoE kernel takes symmetric experts only, of group size 64 or more; a Qwen3-MoE dense
# layer's MLP stays float (vLLM 0.32 fails to load it quantized; the export refuses it).
INT4_MOE = {"model": {"dtype": "float16"}, "passes": [{"name": "awq", "group_size": 64, "zero_point": False}]}
INT4_MOE_DENSE_LAYER_1 = {**INT4_MOE, "passes": [{**INT4_MOE["passes"][0], "modules_to_not_convert": ["lm_head", "layers.1.mlp"]}]}
# vLLM's CPU INT4 MoE kernel (CPUExpertsInt4) runs on AMX tiles only; elsewhere vLLM reads the
# checkpoint's MoE scheme and then finds no backend for it.
HAS_AMX = "amx_tile" in Path("/proc/cpuinfo").read_text()
NO_MOE_BACKEND = "No WNA16 MoE backend supports the deployment configuration"
# name -> (case, pipeline, the vLLM kernel its log must name or None). Gemma 3 INT4 is not here: vLLM
# refuses Gemma 3 in float16, and its bfloat16 INT4 kernel dies of SIGILL on this machine (docs/DEPLOY.md).
MODELS = {
    "qwen3-float": ("qwen3", FLOAT, None),
    "qwen3-int4": ("qwen3", INT4, "CPUWNA16LinearKernel"),
    "qwen3-fp8": ("qwen3", FP8, "CompressedTensorsW8A8Fp8"),
    "gemma3-float": ("gemma3-scalar-linear-rope-softcap", FLOAT, None),
    "gemma3-fp8": ("gemma3-scalar-linear-rope-softcap", FP8, "CompressedTensorsW8A8Fp8"),
    "qwen3-moe-float": ("qwen3-moe-dense-layer-unnormalised", FLOAT, None),
    "qwen3-moe-int4": ("qwen3-moe-64-dense-layer-1", INT4_MOE_DENSE_LAYER_1, "CPUExpertsInt4"),
    "mixtral-float": ("mixtral-sliding", FLOAT, None),
    "mixtral-int4": ("mixtral-sliding-128", INT4_MOE, "CPUExpertsInt4"),
}


def save_arch_checkpoint(root: Path, case: str) -> Path:
    tokenizer = make_byte_tokenizer()
    base, overrides = OWN_CASES.get(case, (case, {}))
    model = make_arch_model(base, vocab_size=len(tokenizer), **SHAPE, **overrides)
    path = root / f"ckpt-{case}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"vLLM is not installed at {VLLM_PYTHON}; run scripts/setup_vllm.sh (scripts/setup.sh does)")
    root = tmp_path_factory.mktemp("vllm-archs")
    return {case: save_arch_checkpoint(root, case) for case in {case for case, _, _ in MODELS.values()}}


@pytest.mark.parametrize("name", list(MODELS))
def test_vllm_runs_the_architecture_as_the_engine_does(checkpoints, name, tmp_path):
    case, pipeline, kernel = MODELS[name]
    artifact = compile_for(checkpoints[case], pipeline, tmp_path / "artifact")
    checkpoint = lower(artifact, "vllm", tmp_path / "vllm").path
    if kernel == "CPUExpertsInt4" and not HAS_AMX:
        assert_refused_without_amx(checkpoint, tmp_path / "vllm.log")
        return
    if kernel == "CPUWNA16LinearKernel" and not vllm_here().w4a16:
        assert_vllm_refuses_int4(checkpoint, tmp_path / "vllm.log")
        assert_decompresses_to_the_artifact(artifact, checkpoint, tmp_path / "decompressed.safetensors")
        return
    server = start_server(checkpoint, tmp_path / "vllm.log")
    try:
        result = compare_with_engine(artifact, server.url, server.model)
        if kernel:
            assert kernel in (tmp_path / "vllm.log").read_text(errors="replace"), f"vLLM did not run its {kernel}"
        print(name, result)
    finally:
        assert server.stop() == 0


def assert_refused_without_amx(checkpoint: Path, log: Path) -> None:
    """On a CPU without AMX, vLLM gets as far as the checkpoint's INT4 MoE scheme and refuses it for
    want of a kernel, not for anything in the export (started past qcompile's up-front host check,
    which on an AVX2 host refuses the checkpoint's INT4 attention layers first)."""
    assert_vllm_fails_to_start(tiny_server(checkpoint, log), "Using CompressedTensorsWNA16MoEMethod", NO_MOE_BACKEND)
