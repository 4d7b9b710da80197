"""Checkpoint loading: HF directories (single, sharded, pickled), GGUF, and every bad input."""
import json

import numpy as np
import pytest
import torch
from conftest import make_hf_model
from gguf_helpers import write_gguf

from compiler.errors import CheckpointError
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


def test_gguf_matches_hf(tmp_path):
    hf = make_hf_model("llama")
    write_gguf(tmp_path / "tiny.gguf", hf)
    ours = load_checkpoint(tmp_path / "tiny.gguf", with_tokenizer=False).model
    x = torch.arange(20)[None]
    with torch.no_grad():
        ref = hf(x).logits
    assert ((ours(x) - ref).norm() / ref.norm()).item() < 1e-5


def test_truncated_gguf(tmp_path):
    hf = make_hf_model("llama")
    write_gguf(tmp_path / "tiny.gguf", hf)
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cut.gguf"):
        load_checkpoint(tmp_path / "cut.gguf", with_tokenizer=False)
