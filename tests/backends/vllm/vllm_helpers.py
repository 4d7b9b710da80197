"""Tiny models vLLM's CPU backend runs, compiled as INT4 or FP8 for the vllm target, and the
artifact's math with vLLM's CPU roundings (``vllm_cpu_reference``)."""
from __future__ import annotations

import copy
import types
from pathlib import Path

import torch
from conftest import make_byte_tokenizer, make_hf_model

from compiler.formats.fp8 import Fp8Linear
from compiler.formats.fp8_kv import Fp8KVQuant
from compiler.quant.fp8 import fp8_max, scale_from_amax

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
# FP8 W8A8 (per-channel weights, dynamic per-token activations), and the same with an FP8 KV cache
# (one scale per layer). max_layer_error is raised so that no layer of the random model falls back to float.
FP8 = {"passes": [{"name": "fp8", "input_shift": False, "max_layer_error": 10.0}]}
FP8_KV = {"passes": [{**FP8["passes"][0], "kv_cache_dtype": "float8_e4m3fn", "kv_cache_granularity": "per_tensor"}]}


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


def _cast_toward_zero(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 codes of ``x`` (saturated) rounded toward zero: torch rounds to nearest, then steps back a code where that grew |x|."""
    x = x.float().clamp(-fp8_max(dtype), fp8_max(dtype))
    nearest = x.to(dtype)
    grew = nearest.float().abs() > x.abs()  # never at code 0, so the step below never wraps
    return torch.where(grew, (nearest.view(torch.uint8) - 1).view(dtype), nearest)


class _TruncatingKVQuant(Fp8KVQuant):
    """The FP8 KV round trip as vLLM 0.32's CPU attention writes its cache (codes rounded toward zero)."""

    def forward(self, k, v):
        if self.dtype_name != "float8_e4m3fn":
            raise ValueError("vLLM's CPU KV rounding was measured for float8_e4m3fn only")
        dtype = torch.float8_e4m3fn
        ks, vs = self.k_scale.reshape(1, -1, 1, 1), self.v_scale.reshape(1, -1, 1, 1)
        return ((_cast_toward_zero(k / ks, dtype).float() * ks).to(k.dtype),
                (_cast_toward_zero(v / vs, dtype).float() * vs).to(v.dtype))


def _quantize_rows_by_reciprocal(self: Fp8Linear, x: torch.Tensor):
    """Dynamic per-token FP8 codes as vLLM's ``QuantFP8`` makes them: x times the reciprocal of the scale."""
    scale = scale_from_amax(x.float().abs().amax(dim=-1), self.format.activation_torch_dtype)
    codes = (x.float() * scale.reciprocal()[:, None]).clamp(-fp8_max(self.format.activation_torch_dtype),
                                                            fp8_max(self.format.activation_torch_dtype))
    return codes.to(self.format.activation_torch_dtype), scale


def vllm_cpu_reference(model: torch.nn.Module) -> torch.nn.Module:
    """A float32 copy of the artifact's ``model`` that rounds where vLLM 0.32 on the CPU rounds.

    Two roundings differ from qcompile's own (both measured against vLLM on the tiny models here):
    its CPU attention (``cpu_attn_reshape_and_cache``) writes FP8 KV codes rounded toward zero, where
    torch, compressed-tensors and qcompile round to nearest; and its activation quantizer multiplies
    by the scale's reciprocal where qcompile divides (one ulp apart, enough to flip an FP8 code now and
    then). With both, vLLM's prompt log-probabilities equal this model's to 2e-6 on qwen2 FP8 + FP8 KV.
    INT4 models and FP8 models without a KV cache come back unchanged but for the float32 copy.
    """
    ref = copy.deepcopy(model).float()
    for module in ref.modules():
        if isinstance(module, Fp8Linear) and module.format.dynamic:
            if module.input_shift is not None or module.outlier_index is not None or module.format.activation_group_size:
                raise ValueError("vllm_cpu_reference models plain per-token FP8 activations only")
            module.quantize_input = types.MethodType(_quantize_rows_by_reciprocal, module)
    for layer in ref.layers:
        quant = layer.self_attn.kv_quant
        if quant is not None:
            layer.self_attn.kv_quant = _TruncatingKVQuant(quant.dtype_name, quant.k_scale, quant.v_scale)
    return ref
