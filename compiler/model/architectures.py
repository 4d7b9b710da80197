"""What tells one supported decoder architecture from another, as data.

``ModelConfig`` holds a model's sizes and options (from its ``config.json`` or GGUF metadata);
this table holds what follows from the architecture alone: which norms a layer has and where,
the activation, how the feed-forward is routed and what its modules are called. The decoder
(``transformer.py``, ``layers.py``, ``moe.py``) assembles itself from an ``ArchSpec``, and a pass
that needs to know the structure (which Linears are routers) reads the same entry; AWQ's
smoothing mappings are a table beside the pass, keyed by the same names (``passes/awq_mappings.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ArchSpec:
    """The structure of one architecture's decoder layers."""

    name: str  # the HF class name in ``config.json``'s ``architectures``
    model_type: str  # ``config.json``'s ``model_type``
    # RMSNorm over each head's q and k (``self_attn.q_norm`` / ``k_norm``), before RoPE.
    qk_norm: bool = False
    # Gemma's RMSNorm multiplies by (offset + weight), its weights stored as offsets from 1.
    norm_weight_offset: float = 0.0
    # Gemma: ``post_attention_layernorm`` normalises the attention output before the residual
    # add, ``pre_feedforward_layernorm`` feeds the MLP and ``post_feedforward_layernorm`` its
    # output; without it ``post_attention_layernorm`` is the MLP's input norm (Llama).
    sandwich_norms: bool = False
    scale_embeddings: bool = False  # Gemma: embeddings times √dim
    activation: Literal["silu", "gelu_tanh"] = "silu"
    # "gqa": q/k/v_proj heads (``layers.Attention``); "mla": DeepSeek's multi-head latent
    # attention, low-rank q and kv projections with decoupled RoPE (``mla.MLAttention``).
    attention: Literal["gqa", "mla"] = "gqa"
    # The feed-forward: "dense" (``mlp``: gate/up/down_proj), or routed experts: "qwen_moe"
    # (``mlp.gate`` router, ``mlp.experts.N.{gate,up,down}_proj``), "mixtral"
    # (``block_sparse_moe.gate``, ``block_sparse_moe.experts.N.{w1,w3,w2}``), "deepseek_moe"
    # (``mlp.gate`` grouped sigmoid router, ``mlp.experts.N.*`` plus ``mlp.shared_experts.*``).
    ffn: Literal["dense", "qwen_moe", "mixtral", "deepseek_moe"] = "dense"
    # The router of an MoE layer, relative to the layer: every quantizing pass keeps it in float
    # (a rounded router changes which experts a token reaches, not just by how much).
    router: str | None = None
    # Why the decoder cannot run in float16, where it cannot: a compile in float16 is refused (as vLLM
    # refuses to serve such a model in float16).
    float16_unsafe: str | None = None

    @property
    def is_moe(self) -> bool:
        return self.ffn != "dense"


ARCHITECTURES = {spec.name: spec for spec in (
    ArchSpec("LlamaForCausalLM", "llama"),
    ArchSpec("MistralForCausalLM", "mistral"),
    ArchSpec("Qwen2ForCausalLM", "qwen2"),
    ArchSpec("Qwen3ForCausalLM", "qwen3", qk_norm=True),
    ArchSpec("Gemma3ForCausalLM", "gemma3_text", qk_norm=True, norm_weight_offset=1.0, sandwich_norms=True,
             scale_embeddings=True, activation="gelu_tanh",
             float16_unsafe="its activations pass float16's largest value, 65504 (Gemma 3 270M's turn to NaN from "
                            "layer 8)"),
    ArchSpec("Qwen3MoeForCausalLM", "qwen3_moe", qk_norm=True, ffn="qwen_moe", router="mlp.gate"),
    ArchSpec("MixtralForCausalLM", "mixtral", ffn="mixtral", router="block_sparse_moe.gate"),
    ArchSpec("DeepseekV3ForCausalLM", "deepseek_v3", attention="mla", ffn="deepseek_moe", router="mlp.gate"),
)}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
ARCHITECTURE_OF_MODEL_TYPE = {spec.model_type: spec.name for spec in ARCHITECTURES.values()}

# The names HF gives a layer's attention types (``config.json``'s ``layer_types``).
FULL, SLIDING = "full_attention", "sliding_attention"
