"""A tiny Gemma 3 written as llama.cpp's converter writes a gemma3 GGUF (norm weights stored as
1 + w, no q/k permutation, transformers' defaults for what the file leaves out) loads to the
transformers model's logits."""
import numpy as np
import pytest
import torch
from arch_helpers import make_arch_model

from compiler.errors import CheckpointError
from compiler.io.gguf import _GEMMA3_LAYER_TENSORS
from compiler.io.load import load_checkpoint


def write_gemma3_gguf(path, hf, rope_scaling: str | None = None):
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_sliding_window(c.sliding_window)
    w.add_vocab_size(c.vocab_size)
    if rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling))
    to_gguf = {v: k for k, v in _GEMMA3_LAYER_TENSORS.items()}
    for name, t in hf.state_dict().items():
        a = t.numpy().astype(np.float32)
        name = name.removeprefix("model.")
        if name == "lm_head.weight":
            continue  # tied
        if name.startswith("layers."):
            _, i, *rest = name.split(".")
            gname = f"blk.{i}.{to_gguf['.'.join(rest[:-1])]}.{rest[-1]}"
        else:
            gname = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}[name]
        if gname.endswith("norm.weight"):
            a = a + 1  # llama.cpp's Gemma norms multiply by the stored weight
        w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_gemma3():
    # Six layers, so transformers' default pattern (every sixth layer global) has a global one; the
    # default query_pre_attn_scalar of 256 against head_dim 16 exercises the score scale.
    return make_arch_model("gemma3", num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=256)


def test_gemma3_gguf_matches_hf(tmp_path):
    hf = tiny_gemma3()
    write_gemma3_gguf(tmp_path / "tiny.gguf", hf)
    ours = load_checkpoint(tmp_path / "tiny.gguf", with_tokenizer=False).model
    assert ours.config.layer_types == hf.config.layer_types
    x = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(0))  # past the window of 8
    with torch.no_grad():
        ref = hf(x).logits
    assert ((ours(x) - ref).norm() / ref.norm()).item() < 1e-5


def test_gemma3_gguf_with_rope_scaling_is_refused(tmp_path):
    write_gemma3_gguf(tmp_path / "scaled.gguf", tiny_gemma3(), rope_scaling="linear")
    with pytest.raises(CheckpointError, match="rope scaling 'linear' is not supported"):
        load_checkpoint(tmp_path / "scaled.gguf", with_tokenizer=False)
