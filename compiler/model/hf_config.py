"""Read a Hugging Face ``config.json`` dict into ``ModelConfig``'s fields, one architecture at a time.

Both the transformers 4 spelling (``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``,
``num_experts``) and the transformers 5 one (``rope_parameters``, per layer type for Gemma 3;
``num_local_experts``) are read. Whatever the decoder cannot reproduce (a RoPE type, an
activation, attention soft-capping, ...) stops here with one line naming it.
"""
from __future__ import annotations

from typing import Any

from compiler.errors import CheckpointError
from compiler.model.architectures import (
    ARCHITECTURE_OF_MODEL_TYPE,
    ARCHITECTURES,
    FULL,
    SLIDING,
    SUPPORTED_ARCHITECTURES,
)

ROPE_TYPES = ("default", "linear", "llama3")
MLA_ROPE_TYPES = (*ROPE_TYPES, "yarn")  # DeepSeek-V3 ships with yarn (its attention reads the mscale too)
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def unsupported(what: str) -> CheckpointError:
    return CheckpointError(f"unsupported architecture {what!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def hf_architecture(hf: dict) -> str:
    model_type = hf.get("model_type", "?")
    arch = (hf.get("architectures") or [ARCHITECTURE_OF_MODEL_TYPE.get(model_type, model_type)])[0]
    if arch == "Gemma3ForConditionalGeneration":
        raise CheckpointError("Gemma3ForConditionalGeneration (text + vision) is not supported; "
                              "a text-only Gemma3ForCausalLM checkpoint is")
    if arch not in ARCHITECTURES:
        raise unsupported(arch)
    return arch


def _rope_scaling(params: dict | None, supported: tuple[str, ...] = ROPE_TYPES) -> dict | None:
    """A RoPE scaling entry (HF ``rope_scaling`` or a ``rope_parameters`` dict): None when default."""
    if not params:
        return None
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in supported:
        raise CheckpointError(f"unsupported rope scaling {rope_type!r}; supported: {', '.join(supported)}")
    if rope_type == "default":
        return None
    return {**{k: v for k, v in params.items() if k not in ("rope_theta", "type")}, "rope_type": rope_type}


def _rope(hf: dict, supported: tuple[str, ...] = ROPE_TYPES) -> tuple[float | None, dict | None]:
    """(theta, scaling) of a single-RoPE architecture."""
    params = hf.get("rope_parameters")  # transformers >= 5 nests theta and scaling here
    theta, scaling = hf.get("rope_theta"), hf.get("rope_scaling")
    if isinstance(params, dict):
        theta = theta or params.get("rope_theta")
        scaling = scaling or (params if params.get("rope_type", "default") != "default" else None)
    return theta, _rope_scaling(scaling, supported)


def _gemma_rope(hf: dict) -> dict[str, Any]:
    """Gemma 3: global layers' theta and scaling, and the sliding layers' own (unscaled) base."""
    params = hf.get("rope_parameters") or {}
    full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
    if _rope_scaling(local):
        raise CheckpointError("Gemma 3 with RoPE scaling on its sliding-window layers is not supported")
    return dict(rope_theta=full.get("rope_theta") or hf.get("rope_theta") or 1_000_000.0,
                rope_scaling=_rope_scaling(hf.get("rope_scaling") or full),
                rope_local_theta=local.get("rope_theta") or hf.get("rope_local_base_freq") or 10_000.0)


def _activation(hf: dict, arch: str) -> None:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if _ACTIVATIONS.get(act) != ARCHITECTURES[arch].activation:
        raise CheckpointError(f"{arch} with activation {act!r} is not supported; it uses "
                              f"{ARCHITECTURES[arch].activation}")


def _refuse(hf: dict, arch: str) -> None:
    """Options of the architecture that the decoder does not reproduce."""
    _activation(hf, arch)
    if arch.startswith("Qwen") and hf.get("use_sliding_window"):
        raise CheckpointError(f"{arch} with use_sliding_window=true is not supported; set it to false")
    if hf.get("attn_logit_softcapping") is not None:
        raise CheckpointError(f"{arch} with attn_logit_softcapping={hf['attn_logit_softcapping']} is not supported "
                              "(Gemma 3 checkpoints set it to null)")
    if hf.get("use_bidirectional_attention"):
        raise CheckpointError(f"{arch} with use_bidirectional_attention=true (an encoder) is not supported")
    if hf.get("shared_expert_intermediate_size"):
        raise CheckpointError(f"{arch} with shared experts is not supported")


def _gemma_layer_types(hf: dict) -> list[str]:
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    return [SLIDING if (i + 1) % pattern else FULL for i in range(hf["num_hidden_layers"])]


def _moe(hf: dict, arch: str) -> dict[str, Any]:
    experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
    fields = dict(num_experts=experts, num_experts_per_tok=hf.get("num_experts_per_tok", 0))
    if arch == "MixtralForCausalLM":  # every layer routed, experts as wide as intermediate_size, top-k renormalised
        return fields | dict(moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    moe_layers = [i for i in range(hf["num_hidden_layers"]) if i not in dense and experts and (i + 1) % step == 0]
    return fields | dict(moe_intermediate_size=hf["moe_intermediate_size"], norm_topk_prob=bool(hf.get("norm_topk_prob")),
                         moe_layers=moe_layers)


def _deepseek(hf: dict) -> dict[str, Any]:
    """DeepSeek-V3: multi-head latent attention, and routed plus shared experts after the first
    ``first_k_dense_replace`` dense layers (``moe_layer_freq`` 1, as every released checkpoint)."""
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if hf.get(key, want) != want:
            raise CheckpointError(f"DeepseekV3ForCausalLM with {key}={hf[key]!r} is not supported (DeepSeek-V3 uses {want!r})")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise CheckpointError(f"DeepseekV3ForCausalLM checkpoint quantized with {method!r} is not supported; "
                              "load a bfloat16 or float32 checkpoint (dequantize it first)")
    theta, scaling = _rope(hf, MLA_ROPE_TYPES)
    first_dense = hf.get("first_k_dense_replace") or 0
    experts = hf.get("n_routed_experts") or 0
    return dict(
        rope_theta=theta or 10000.0, rope_scaling=scaling, qkv_bias=bool(hf.get("attention_bias")),
        o_bias=bool(hf.get("attention_bias")), head_dim=hf["qk_rope_head_dim"],
        n_kv_heads=hf["num_attention_heads"],  # MLA has no KV heads of its own: every head reads the latent
        q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"], v_head_dim=hf["v_head_dim"],
        rope_interleave=bool(hf.get("rope_interleave", True)),
        num_experts=experts, num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
        moe_intermediate_size=hf["moe_intermediate_size"], norm_topk_prob=bool(hf.get("norm_topk_prob")),
        moe_layers=[i for i in range(hf["num_hidden_layers"]) if i >= first_dense] if experts else [],
        n_shared_experts=hf.get("n_shared_experts") or 0, n_group=hf.get("n_group") or 1,
        topk_group=hf.get("topk_group") or 1, routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))


def _architecture_fields(hf: dict, arch: str) -> dict[str, Any]:
    """The fields that differ per architecture (biases, windows, RoPE bases, experts)."""
    bias = bool(hf.get("attention_bias", False))
    if arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        theta, scaling = _rope(hf)
        return dict(rope_theta=theta or 10000.0, rope_scaling=scaling,
                    qkv_bias=arch == "Qwen2ForCausalLM" or bias, o_bias=arch != "Qwen2ForCausalLM" and bias,
                    sliding_window=hf.get("sliding_window") if arch == "MistralForCausalLM" else None)
    if arch == "Gemma3ForCausalLM":
        layer_types = _gemma_layer_types(hf)
        return _gemma_rope(hf) | dict(
            qkv_bias=bias, o_bias=bias, layer_types=layer_types,
            sliding_window=hf.get("sliding_window") if SLIDING in layer_types else None,
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
            final_logit_softcapping=hf.get("final_logit_softcapping"))
    if arch == "DeepseekV3ForCausalLM":
        return _deepseek(hf)
    theta, scaling = _rope(hf)
    fields = dict(rope_theta=theta or 10000.0, rope_scaling=scaling, qkv_bias=bias, o_bias=bias)
    if arch == "MixtralForCausalLM":
        fields["sliding_window"] = hf.get("sliding_window")
    return fields | (_moe(hf, arch) if ARCHITECTURES[arch].is_moe else {})


def config_fields(hf: dict) -> dict[str, Any]:
    """``ModelConfig(**config_fields(hf))`` for a Hugging Face ``config.json`` dict."""
    arch = hf_architecture(hf)
    _refuse(hf, arch)
    fields = dict(
        architecture=arch,
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"],
        head_dim=hf.get("head_dim") or 0,
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        max_seq_len=hf.get("max_position_embeddings", 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", arch == "Gemma3ForCausalLM")),  # Gemma ties by default
        mlp_bias=bool(hf.get("mlp_bias", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
    )
    return fields | _architecture_fields(hf, arch)
