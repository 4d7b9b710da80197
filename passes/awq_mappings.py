"""AWQ's smoothing mappings, as data per architecture, and the fold that applies a scale.

A mapping (``ScalingGroup``) names a module ``prev`` whose output channels are the input of
``linears``: scaling those input columns by s and ``prev``'s output by 1/s leaves the float
model unchanged, so the scales can be chosen to protect the channels that matter to
quantization (llm-compressor keeps its mappings the same way, keyed by architecture). Names are
relative to a decoder layer; ``{e}`` stands for every expert of an MoE layer: in ``prev`` it
makes one group per expert, in ``linears`` alone it lists every expert's linear in one group.

When each fold is exact (float arithmetic aside), and why:

- ``input_layernorm → q, k, v`` (every architecture): the norm's output feeds only q/k/v. In
  Qwen3 and Gemma 3 the q/k RMSNorms act on q_proj/k_proj's *outputs*, which the fold leaves
  unchanged (it scales their input columns), so it stays exact there; what would not be exact is
  a scale on q/k's output channels (RMSNorm over a head does not commute with a per-channel
  scale), and no mapping here does that.
- ``v_proj → o_proj``: attention mixes v's rows over positions, never its channels, so a
  per-channel scale on v passes through to o's input columns (GQA: each v channel feeds
  n_heads / n_kv_heads columns of o, ``expand_columns``). Gemma 3's ``post_attention_layernorm``
  acts on o_proj's output, which the fold leaves unchanged: still exact.
- The MLP's input norm → gate, up: ``post_attention_layernorm`` in the Llama family,
  ``pre_feedforward_layernorm`` in Gemma 3 (its post-norms act on sub-block outputs).
- ``up_proj → down_proj``: act(gate) · up is linear in each channel of up; Gemma's
  ``post_feedforward_layernorm`` acts on down's output, again unchanged.
- Gemma's RMSNorm multiplies by (1 + w): dividing it by s sets w' = (1 + w) / s − 1
  (``fold_scales`` reads the norm's ``weight_offset``). In float32 w' is exact to ~1e-7 of 1;
  in bfloat16 it rounds at 2⁻⁸ of |w'| (a coarser fold than Llama's w / s).
- MoE layers: the norm feeds the router and every expert's gate/up, so the router is a member of
  the group (first, so its all-token statistics give mean |x|): the passes never quantize it
  (``ArchSpec.router``), but its columns take s so that the routing is unchanged. Each expert's
  up → down is its own group, on the tokens routed to that expert.
- DeepSeek-V3 (multi-head latent attention; llm-compressor's mappings for MLA, plus the experts):
  ``input_layernorm → q_a_proj (or q_proj), kv_a_proj_with_mqa``; ``q_a_layernorm → q_b_proj``;
  ``kv_a_layernorm → kv_b_proj`` (the cached latent is the scaled c, kv_b_proj undoes it).
  o_proj is not smoothed (``prev`` None), as llm-compressor: its input channels are values that
  kv_b_proj makes together with the keys' rows, a fold a (prev, linears) pair cannot name (it
  would divide only kv_b_proj's value rows by s). The MLP norm feeds the router (a float module
  of its own, no Linear, whose weight columns take the scales), the shared experts' and every
  routed expert's gate/up; each expert's up → down (shared ones too) is its own group.

A new architecture joins by an entry in ``SMOOTHING`` (its dense and MoE layers' groups);
``tests/passes/test_awq_architectures.py`` checks each entry's folds leave the float model
unchanged under random scales.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from compiler.model.config import ModelConfig

EXPERT = "{e}"


@dataclass(frozen=True)
class ScalingGroup:
    """Linears sharing one input whose channels ``prev`` (an RMSNorm or a Linear) produces:
    scaling those input channels by s and ``prev``'s output by 1/s leaves the float model unchanged.
    ``linears[0]``'s input statistics give the group's mean |x|: it must read every token ``prev`` does.
    ``prev`` None: no smoothing, the linears are only clipped and quantized on their statistics."""

    prev: str | None
    linears: tuple[str, ...]
    # The module whose output scores the α grid when it is more than the linears themselves
    # (AutoAWQ's ``module2inspect``): errors in q/k pass through softmax, in gate/up through SiLU.
    inspect: str | None = None
    # Whether duo scaling applies here under duo_scaling = "auto". On SmolLM2-135M
    # (docs/notes/2026-11-awq-int4-smollm2.md) duo scaling on up → down costs 0.29 perplexity at g128
    # and gains 0.12 at g64, so "auto" leaves it out there; "all" (AutoAWQ) puts it back.
    duo: bool = True


@dataclass(frozen=True)
class LayerMappings:
    """One architecture's groups: for its dense layers, and (MoE architectures) its routed layers."""

    dense: tuple[ScalingGroup, ...]
    moe: tuple[ScalingGroup, ...] = ()


def _mlp(norm: str, ffn: str = "mlp", gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj",
         router: str | None = None) -> tuple[ScalingGroup, ...]:
    """norm → [router,] gate, up; up → down (in each expert when ``router`` is given)."""
    base = f"{ffn}.experts.{EXPERT}." if router else f"{ffn}."
    first = (f"{ffn}.{router}",) if router else ()
    return (ScalingGroup(norm, first + (base + gate, base + up), inspect=ffn),
            ScalingGroup(base + up, (base + down,), duo=False))


# llm-awq / AutoAWQ's attention mappings: the same in every architecture here.
ATTENTION = (
    ScalingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), inspect="self_attn"),
    ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",)),
)
LLAMA = LayerMappings(ATTENTION + _mlp("post_attention_layernorm"))


def _deepseek(config: ModelConfig) -> LayerMappings:
    """DeepSeek-V3's groups: MLA's (q_lora_rank 0: one q_proj), then the dense MLP's (the first
    ``first_k_dense_replace`` layers) or the router's, shared and routed experts'."""
    q = ("self_attn.q_a_proj",) if config.q_lora_rank else ("self_attn.q_proj",)
    mla = (ScalingGroup("input_layernorm", (*q, "self_attn.kv_a_proj_with_mqa"), inspect="self_attn"),
           *((ScalingGroup("self_attn.q_a_layernorm", ("self_attn.q_b_proj",), inspect="self_attn"),)
             if config.q_lora_rank else ()),
           ScalingGroup("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",), inspect="self_attn"),
           ScalingGroup(None, ("self_attn.o_proj",)))
    shared = ("mlp.shared_experts",) if config.n_shared_experts else ()
    gate_up = tuple(f"{m}.{p}" for m in (*shared, f"mlp.experts.{EXPERT}") for p in ("gate_proj", "up_proj"))
    experts = (ScalingGroup("post_attention_layernorm", ("mlp.gate", *gate_up), inspect="mlp"),
               *(ScalingGroup(f"{m}.up_proj", (f"{m}.down_proj",), duo=False) for m in shared),
               ScalingGroup(f"mlp.experts.{EXPERT}.up_proj", (f"mlp.experts.{EXPERT}.down_proj",), duo=False))
    return LayerMappings(mla + _mlp("post_attention_layernorm"), mla + experts)


# Per architecture: its mappings, or a function of the config giving them (where they depend on it).
SMOOTHING: dict[str, LayerMappings | Callable[[ModelConfig], LayerMappings]] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,
    "Qwen3ForCausalLM": LLAMA,
    "Gemma3ForCausalLM": LayerMappings(ATTENTION + _mlp("pre_feedforward_layernorm")),
    "Qwen3MoeForCausalLM": LayerMappings(LLAMA.dense, ATTENTION + _mlp("post_attention_layernorm", router="gate")),
    "MixtralForCausalLM": LayerMappings(LLAMA.dense, ATTENTION + _mlp("post_attention_layernorm", "block_sparse_moe",
                                                                      "w1", "w3", "w2", router="gate")),
    "DeepseekV3ForCausalLM": _deepseek,
}

# Attention logits are a product of q and k: clipping them by their own output error misleads
# (llm-awq skips them too). MLA's q and k come from all its projections but o_proj.
NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.q_a_proj", "self_attn.q_b_proj",
           "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj")


def layer_groups(config: ModelConfig, layer_idx: int) -> tuple[ScalingGroup, ...]:
    """The groups of layer ``layer_idx``, ``{e}`` expanded over its experts."""
    mappings = SMOOTHING[config.architecture]
    mappings = mappings(config) if callable(mappings) else mappings
    if not config.is_moe_layer(layer_idx):
        return mappings.dense
    experts = range(config.num_experts)
    out = []
    for g in mappings.moe:
        if g.prev is not None and EXPERT in g.prev:
            out += [ScalingGroup(g.prev.replace(EXPERT, str(e)), tuple(n.replace(EXPERT, str(e)) for n in g.linears),
                                 g.inspect, g.duo) for e in experts]
        else:
            linears = [n.replace(EXPERT, str(e)) for n in g.linears for e in (experts if EXPERT in n else [0])]
            out.append(replace(g, linears=tuple(linears)))
    return tuple(out)


def expand_columns(block: torch.nn.Module, group: ScalingGroup, config: ModelConfig) -> torch.Tensor | None:
    """Map from the consumers' input columns to ``prev``'s output channels (GQA: v → o), or None
    where they are the same."""
    prev = block.get_submodule(group.prev)
    k = block.get_submodule(group.linears[0]).in_features
    c = prev.weight.shape[0]
    if c == k:
        return None
    hd, n_rep = config.head_dim, config.n_heads // config.n_kv_heads
    if c * n_rep != k or not isinstance(prev, torch.nn.Linear):
        raise ValueError(f"{group.prev} ({c} outputs) cannot feed {group.linears[0]} ({k} inputs)")
    col = torch.arange(k)
    return (col // hd // n_rep) * hd + col % hd  # q head h reads kv head h // n_rep


@torch.no_grad()
def fold_scales(block: torch.nn.Module, group: ScalingGroup, s: torch.Tensor, s_cols: torch.Tensor) -> None:
    """x' = x / s at ``prev``'s output (s [C]), W' = W * s on every member's columns (s_cols [K])."""
    prev = block.get_submodule(group.prev)
    if isinstance(prev, torch.nn.Linear):
        prev.weight.div_(s.to(prev.weight.dtype)[:, None])
        if prev.bias is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    elif prev.weight_offset:  # RMSNorm times (offset + w): (offset + w') = (offset + w) / s
        o = prev.weight_offset
        prev.weight.copy_(((prev.weight.float() + o) / s - o).to(prev.weight.dtype))
    else:  # RMSNorm: y = weight * normalised(x)
        prev.weight.div_(s.to(prev.weight.dtype))
    for name in group.linears:
        lin = block.get_submodule(name)
        lin.weight.mul_(s_cols.to(lin.weight.dtype)[None, :])
