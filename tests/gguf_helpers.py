"""Write a tiny transformers model as a GGUF file the way llama.cpp's converter (convert_hf_to_gguf.py)
does, F32 tensors: the tensor names from the ``gguf`` package's own HF -> GGUF name map (not
qcompile's tables), llama's q/k rows permuted for its RoPE, Gemma's norms stored as 1 + w, a MoE
layer's experts stacked into one ``ffn_{gate,up,down}_exps`` tensor each, and the metadata keys
the converter writes. Optionally the 2-D and stacked weights quantized (``quant``: Q8_0, or Q4_1 as
the built-in SmolLM2) and a byte-level BPE tokenizer in the metadata (``tokenizer``)."""
from __future__ import annotations

import json

import numpy as np

# The model_type of the transformers model -> llama.cpp's architecture (Mixtral is written as llama).
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
             "gemma3_text": "gemma3", "mixtral": "llama"}


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation for llama: rotate-half halves -> interleaved RoPE pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_theta(c) -> float:
    params = c.rope_parameters
    return (params.get("full_attention") or params)["rope_theta"]


def _metadata(w, c, arch: str) -> None:
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    if getattr(c, "head_dim", None):  # the converter writes key/value length when the config has head_dim
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_rope_freq_base(_rope_theta(c))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if getattr(c, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)


def _tensors(hf, arch: str):
    """(GGUF name, array) for each tensor of ``hf`` as the converter writes it."""
    import gguf

    c = hf.config
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     c.num_hidden_layers)
    for hf_name, t in hf.state_dict().items():
        a = t.detach().float().numpy()
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if hf_name.endswith((".weight", ".bias")):
            base, suffix = hf_name.rsplit(".", 1)
        else:  # a bare parameter: transformers 5's experts, stacked as in GGUF
            base, suffix = hf_name, "weight"
        if base.endswith("experts.gate_up_proj"):  # transformers 5 fuses each expert's gate and up rows
            width = a.shape[1] // 2
            yield names.get_name(base.replace("gate_up_proj", "gate_proj")) + ".weight", a[:, :width]
            yield names.get_name(base.replace("gate_up_proj", "up_proj")) + ".weight", a[:, width:]
            continue
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"no GGUF name for {hf_name}"
        if arch == "llama" and base.endswith("self_attn.q_proj"):
            a = _permute(a, c.num_attention_heads)
        elif arch == "llama" and base.endswith("self_attn.k_proj"):
            a = _permute(a, c.num_key_value_heads)
        if arch == "gemma3" and base.endswith("norm"):
            a = a + 1  # llama.cpp's Gemma norms multiply by the stored weight
        yield f"{gguf_name}.{suffix}", a


def add_byte_level_tokenizer(w, tokenizer) -> None:
    """``tokenizer`` (a byte-level BPE ``PreTrainedTokenizerFast``) as the converter's ``gpt2`` tokenizer metadata."""
    import gguf

    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    special = set(tokenizer.all_special_tokens)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([token for token, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL for token, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)


def write_gguf(path, hf, general_name: str | None = None, rope_scaling: str | None = None, tokenizer=None,
               quant: str | None = None) -> str:
    """Write transformers model ``hf`` to ``path`` as llama.cpp would; returns the GGUF architecture.
    ``quant`` ("Q8_0", "Q4_1") stores the matrices (2-D and stacked) quantized, norms stay float32."""
    import gguf
    from gguf.quants import quantize

    arch = GGUF_ARCH[hf.config.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    if general_name:
        w.add_name(general_name)
    _metadata(w, hf.config, arch)
    if rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling))
    if tokenizer is not None:
        add_byte_level_tokenizer(w, tokenizer)
    for name, a in _tensors(hf, arch):
        a = np.ascontiguousarray(a, dtype=np.float32)
        if quant and a.ndim >= 2:
            qtype = gguf.GGMLQuantizationType[quant]
            w.add_tensor(name, quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arch
