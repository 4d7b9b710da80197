"""Tiny random transformers models of the architectures beyond the Llama family (Qwen3, Gemma 3,
Qwen3-MoE, Mixtral, DeepSeek-V3), built with transformers' own config classes: the references for parity."""
from __future__ import annotations

import torch

SLIDING, FULL = "sliding_attention", "full_attention"
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)

DEEPSEEK = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                v_head_dim=16, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5)

# name -> (transformers family, config overrides)
ARCH_CASES = {
    "qwen3": ("qwen3", {"head_dim": 16}),
    "qwen3-wide-heads-tied": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True, "num_key_value_heads": 1}),
    "gemma3": ("gemma3", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                          "layer_types": [SLIDING, FULL, SLIDING]}),
    "gemma3-scalar-linear-rope-softcap": ("gemma3", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "layer_types": [SLIDING, SLIDING, FULL],
        "final_logit_softcapping": 5.0, "attention_bias": True,
        "rope_parameters": {FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 50_000.0},
                            SLIDING: {"rope_type": "default", "rope_theta": 1_000.0}}}),
    "qwen3-moe": ("qwen3_moe", {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "qwen3-moe-dense-layer-unnormalised": ("qwen3_moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                                         "moe_intermediate_size": 24, "mlp_only_layers": [1]}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "mixtral-sliding": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8}),
    # MLA with a q bottleneck, interleaved RoPE; 8 experts in 4 groups, the best 2 groups kept,
    # top-2 renormalised and scaled; one shared expert; layer 0 dense.
    "deepseek-v3": ("deepseek_v3", DEEPSEEK),
    # One q_proj, rotate-half RoPE with yarn (mscale_all_dim: the softmax scale changes too), two
    # shared experts, weights not renormalised, two dense layers.
    "deepseek-v3-q-proj-yarn": ("deepseek_v3", {
        **DEEPSEEK, "q_lora_rank": None, "rope_interleave": False, "n_shared_experts": 2, "norm_topk_prob": False,
        "first_k_dense_replace": 2, "routed_scaling_factor": 1.5,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "mscale": 1.0,
                            "mscale_all_dim": 0.7, "original_max_position_embeddings": 16}}),
}


def _classes(family: str):
    import transformers as tf

    return {"qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM), "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
            "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
            "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
            "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM)}[family]


def make_arch_model(case: str, seed: int = 0, **overrides):
    """The transformers model of ``ARCH_CASES[case]``, weights large enough for clear-cut argmaxes
    and norm weights away from their init (so (1 + w) and q/k norms are exercised), and
    DeepSeek's router bias nonzero (it changes which experts are chosen)."""
    family, kwargs = ARCH_CASES[case]
    config_cls, model_cls = _classes(family)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**BASE, **kwargs, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            else:
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.2)
    return model
