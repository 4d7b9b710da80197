"""Model configuration: one dataclass for every supported architecture (``architectures.py``)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from compiler.errors import CheckpointError
from compiler.model.architectures import ARCHITECTURES, FULL, SLIDING, SUPPORTED_ARCHITECTURES, ArchSpec
from compiler.model.hf_config import config_fields, unsupported

__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES"]


@dataclass
class ModelConfig:
    """Sizes and options of a decoder; ``head_dim`` is derived when not given."""

    architecture: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int = 0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias): q/k/v carry a bias
    o_bias: bool = False  # Llama with attention_bias: o_proj carries one too
    mlp_bias: bool = False
    sliding_window: int | None = None  # attend to at most this many past tokens (in the layers ``layer_types`` says)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Per layer "full_attention" or "sliding_attention" (HF's names); None: every layer is
    # sliding when ``sliding_window`` is set (Mistral, Mixtral), else full.
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (the global ones use rope_theta)
    query_pre_attn_scalar: float | None = None  # Gemma 3: scores scale by this ** -0.5, not head_dim ** -0.5
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)
    # Mixture of experts: ``num_experts`` routed experts of width ``moe_intermediate_size``, the
    # top ``num_experts_per_tok`` per token (their weights renormalised with ``norm_topk_prob``),
    # in the layers ``moe_layers`` lists (None: every layer); the other layers are dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: list[int] | None = None
    # DeepSeek-V3's router: sigmoid scores plus ``e_score_correction_bias`` choose the top
    # ``topk_group`` of ``n_group`` expert groups, then the top-k experts within them; the chosen
    # weights (renormalised with ``norm_topk_prob``) are scaled by ``routed_scaling_factor``.
    # ``n_shared_experts`` experts of ``moe_intermediate_size`` each (as one MLP) see every token.
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Multi-head latent attention (DeepSeek-V3): q through a rank-``q_lora_rank`` bottleneck (0: one
    # q_proj), K/V from a rank-``kv_lora_rank`` latent; per head qk_nope_head_dim channels without
    # RoPE and ``head_dim`` (= qk_rope_head_dim) with it, shared by all heads; values of v_head_dim.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # DeepSeek: RoPE rotates adjacent pairs (x0, x1), (x2, x3), ...

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise unsupported(self.architecture)
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise CheckpointError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        self._check_layer_types()
        self._check_experts()
        self._check_mla()

    def _check_layer_types(self) -> None:
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.n_layers or set(self.layer_types) - {FULL, SLIDING}:
            raise CheckpointError(f"layer_types must give {FULL!r} or {SLIDING!r} for each of the {self.n_layers} "
                                  f"layers, got {self.layer_types}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise CheckpointError("layer_types has sliding_attention layers but sliding_window is not set")

    def _check_experts(self) -> None:
        if not self.spec.is_moe:
            if self.num_experts:
                raise CheckpointError(f"{self.architecture} has no experts, but num_experts={self.num_experts}")
            return
        if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
            raise CheckpointError(f"{self.architecture}: num_experts={self.num_experts}, num_experts_per_tok="
                                  f"{self.num_experts_per_tok} and moe_intermediate_size={self.moe_intermediate_size} "
                                  "must be positive, with num_experts_per_tok <= num_experts")

    def _check_mla(self) -> None:
        if self.spec.attention != "mla":
            return
        if min(self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim, self.head_dim) < 1 or self.head_dim % 2:
            raise CheckpointError(f"{self.architecture}: kv_lora_rank={self.kv_lora_rank}, qk_nope_head_dim="
                                  f"{self.qk_nope_head_dim}, v_head_dim={self.v_head_dim} must be positive and "
                                  f"qk_rope_head_dim={self.head_dim} positive and even")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group or \
                self.num_experts // self.n_group < 2 or self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
            raise CheckpointError(f"{self.architecture}: n_routed_experts={self.num_experts} must split into "
                                  f"n_group={self.n_group} groups of at least 2, with topk_group={self.topk_group} <= "
                                  f"n_group holding at least num_experts_per_tok={self.num_experts_per_tok} experts")

    @property
    def kv_cache_layout(self) -> tuple[int, int, bool]:
        """(heads, dim, with values): what the KV cache holds per token and layer. K and V of
        n_kv_heads x head_dim each, or for MLA its latent alone: one vector of kv_lora_rank +
        qk_rope_head_dim (the normalised c_kv and the roped shared key), from which attention
        expands K and V with kv_b_proj (``compiler/model/mla.py``)."""
        if self.spec.attention == "mla":
            return 1, self.kv_lora_rank + self.head_dim, False
        return self.n_kv_heads, self.head_dim, True

    @property
    def spec(self) -> ArchSpec:
        """The architecture's structure (``architectures.ARCHITECTURES``)."""
        return ARCHITECTURES[self.architecture]

    @property
    def sliding_windows(self) -> list[int | None]:
        """Each layer's attention window (None: full causal attention)."""
        if self.layer_types is None:
            return [self.sliding_window] * self.n_layers
        return [self.sliding_window if t == SLIDING else None for t in self.layer_types]

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s feed-forward is routed experts."""
        return self.spec.is_moe and (self.moe_layers is None or layer_idx in self.moe_layers)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (``hf_config.py`` reads each architecture)."""
        return cls(**config_fields(hf))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
