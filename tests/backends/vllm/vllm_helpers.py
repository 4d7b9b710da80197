"""Tiny models vLLM's CPU backend runs, compiled as INT4 or FP8 for the vllm target."""
from __future__ import annotations

from pathlib import Path

from conftest import make_byte_tokenizer, make_hf_model

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# head_dim 32: vLLM's CPU attention takes head sizes 32, 64, 80, … (not the fixtures' 16); every
# linear's sizes (64, 32, 96) are multiples of 32, as its CPU INT4 kernel needs.
SHAPE = dict(num_attention_heads=2, num_key_value_heads=1)
CALIBRATION = {"samples": 4, "seq_len": 64}
# Group 64 where it divides (q/k/v/o, gate/up: 64 inputs), the fallback 32 on down_proj (96 inputs):
# two config groups. vLLM's INT4 kernels take float16 or bfloat16 activations, not float32; on this
# machine's CPU its bfloat16 W4A16 kernel (AMX) dies of an illegal instruction, float16 runs.
INT4 = {"model": {"dtype": "float16"}, "passes": [{"name": "awq", "group_size": 64}]}
# FP8 W8A8 (per-channel weights, dynamic per-token activations) with an FP8 KV cache (one scale per
# layer). max_layer_error is raised so that no layer of the random model falls back to float.
FP8 = {"passes": [{"name": "fp8", "input_shift": False, "kv_cache_dtype": "float8_e4m3fn",
                   "kv_cache_granularity": "per_tensor", "max_layer_error": 10.0}]}


def save_checkpoint(root: Path, arch: str, tokenizer=None, **overrides) -> Path:
    """A tiny random ``arch`` checkpoint of vLLM-friendly shape, with the byte-level tokenizer beside it."""
    tokenizer = tokenizer or make_byte_tokenizer()
    model = make_hf_model(arch, vocab_size=len(tokenizer), **{**SHAPE, **overrides})
    path = root / f"ckpt-{arch}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def compile_for(checkpoint: Path, pipeline: dict, out: Path, target: str | None = "vllm") -> Path:
    """Compile ``checkpoint`` with ``pipeline`` (a dict like INT4) into the artifact ``out``."""
    import backends  # noqa: F401  (the vllm target, checked by the pipeline)
    import passes  # noqa: F401
    from compiler.pipeline import PipelineConfig
    from compiler.pipeline.compile import compile_model

    config = {"calibration": CALIBRATION, **pipeline}
    if target:
        config["target"] = {"name": target}
    return compile_model(checkpoint, PipelineConfig.from_dict(config), out).path
