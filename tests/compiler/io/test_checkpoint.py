"""Checkpoint loading: HF directories (single, sharded, pickled), GGUF, and every bad input."""
import json

import numpy as np
import pytest
import torch
from conftest import make_hf_model

from compiler.errors import CheckpointError
from compiler.io.gguf import _LAYER_TENSORS
from compiler.io.load import load_checkpoint


def logits(model, seed=0):
    x = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(x)


def test_sharded_safetensors(tmp_path):
    hf = make_hf_model("llama")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = load_checkpoint(tmp_path).model
    with torch.no_grad():
        ref = hf(torch.arange(12)[None]).logits
    assert torch.allclose(ours(torch.arange(12)[None]), ref, rtol=1e-4, atol=1e-5)


def test_pickle_refused_unless_allowed(tmp_path):
    hf = make_hf_model("llama")
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="--allow-pickle"):
        load_checkpoint(tmp_path)
    ours = load_checkpoint(tmp_path, allow_pickle=True).model
    assert torch.isfinite(logits(ours)).all()


def test_pickle_with_code_is_refused_even_when_allowed(tmp_path):
    hf = make_hf_model("llama")
    hf.config.save_pretrained(tmp_path)
    torch.save({"x": np.array([1, 2])}, tmp_path / "pytorch_model.bin")  # not plain tensors: weights_only refuses
    with pytest.raises(CheckpointError, match="weights_only"):
        load_checkpoint(tmp_path, allow_pickle=True)


def test_truncated_safetensors(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(path)


def test_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = make_hf_model("llama")
    hf.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing tensors.*up_proj"):
        load_checkpoint(tmp_path)


def test_unsupported_architecture_names_the_supported_ones(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM"):
        load_checkpoint(path)


def test_missing_path_and_unknown_file(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "weights.npz").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="unsupported file"):
        load_checkpoint(tmp_path / "weights.npz")


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k permutation (the inverse of what our loader undoes)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, hf):
    """Write ``hf`` as a llama GGUF the way llama.cpp's converter does (F32 tensors)."""
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    to_gguf = {v: k for k, v in _LAYER_TENSORS.items()}
    for name, t in hf.state_dict().items():
        a = t.numpy().astype(np.float32)
        name = name.removeprefix("model.")
        if name.startswith("layers."):
            _, i, *rest = name.split(".")
            module, kind = ".".join(rest[:-1]), rest[-1]
            if module == "self_attn.q_proj":
                a = _permute(a, c.num_attention_heads)
            elif module == "self_attn.k_proj":
                a = _permute(a, c.num_key_value_heads)
            gname = f"blk.{i}.{to_gguf[module]}.{kind}"
        else:
            gname = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_matches_hf(tmp_path):
    hf = make_hf_model("llama")
    write_tiny_gguf(tmp_path / "tiny.gguf", hf)
    ours = load_checkpoint(tmp_path / "tiny.gguf", with_tokenizer=False).model
    x = torch.arange(20)[None]
    with torch.no_grad():
        ref = hf(x).logits
    assert ((ours(x) - ref).norm() / ref.norm()).item() < 1e-5


def test_truncated_gguf(tmp_path):
    hf = make_hf_model("llama")
    write_tiny_gguf(tmp_path / "tiny.gguf", hf)
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cut.gguf"):
        load_checkpoint(tmp_path / "cut.gguf", with_tokenizer=False)
