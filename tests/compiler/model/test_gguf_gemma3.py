"""A tiny Gemma 3 written as llama.cpp's converter writes a gemma3 GGUF (norm weights stored as
1 + w, no q/k permutation, transformers' defaults for what the file leaves out) loads to the
transformers model's logits."""
import pytest
import torch
from arch_helpers import make_arch_model
from gguf_helpers import write_gguf

from compiler.errors import CheckpointError
from compiler.io.load import load_checkpoint


def tiny_gemma3():
    # Six layers, so transformers' default pattern (every sixth layer global) has a global one; the
    # default query_pre_attn_scalar of 256 against head_dim 16 exercises the score scale.
    return make_arch_model("gemma3", num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=256)


def test_gemma3_gguf_matches_hf(tmp_path):
    hf = tiny_gemma3()
    write_gguf(tmp_path / "tiny.gguf", hf)
    ours = load_checkpoint(tmp_path / "tiny.gguf", with_tokenizer=False).model
    assert ours.config.layer_types == hf.config.layer_types
    x = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(0))  # past the window of 8
    with torch.no_grad():
        ref = hf(x).logits
    assert ((ours(x) - ref).norm() / ref.norm()).item() < 1e-5


def test_gemma3_gguf_with_rope_scaling_is_refused(tmp_path):
    write_gguf(tmp_path / "scaled.gguf", tiny_gemma3(), rope_scaling="linear")
    with pytest.raises(CheckpointError, match="rope scaling 'linear' is not supported"):
        load_checkpoint(tmp_path / "scaled.gguf", with_tokenizer=False)
