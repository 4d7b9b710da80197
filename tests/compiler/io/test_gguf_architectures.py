"""GGUF loading for every architecture transformers reads that the decoder supports (llama, qwen2,
qwen3, qwen3moe, gemma3): a tiny model written as llama.cpp's converter writes it
(``gguf_helpers.write_gguf``) loads to transformers' own reading of the same file — logits within
1e-4 relative, 32 identical greedy tokens — and both equal the model the file was written from.
Where transformers takes a config default for a key the file holds (qwen3's head_dim, qwen3moe's
expert width), qcompile reads the key; checked against the source model. What transformers does
not read (llama.cpp's Mixtral, DeepSeek's ``deepseek2``, RoPE scaling) is refused in one line.

Broken on purpose once each: qwen3's q/k norms or qwen3moe's router left out of the tensor tables
(missing tensors), the experts split in reverse order (relative error 1.5 to transformers), top-k
not renormalised (0.065), qwen3's q/k rows un-permuted as llama's (0.37), ``key_length`` or the
expert width not read (shapes refused), the Mixtral or RoPE-scaling refusal dropped.
"""
from __future__ import annotations

import pytest
import torch
from arch_helpers import make_arch_model
from conftest import make_hf_model
from gguf_helpers import write_gguf
from numerics import relative_error

from compiler.errors import CheckpointError
from compiler.io.load import load_checkpoint, peek_config

# case -> the transformers model written to GGUF. Qwen3's head_dim and Qwen3-MoE's expert width
# are transformers' defaults (128, 768): its GGUF reader ignores the keys that hold them.
CASES = {
    "llama": lambda: make_hf_model("llama"),
    "qwen2": lambda: make_hf_model("qwen2"),
    "qwen3": lambda: make_arch_model("qwen3", num_hidden_layers=2, head_dim=128),
    "qwen3-tied": lambda: make_arch_model("qwen3", num_hidden_layers=2, head_dim=128, tie_word_embeddings=True),
    "qwen3-moe": lambda: make_arch_model("qwen3-moe", num_hidden_layers=2, num_experts=4, moe_intermediate_size=768),
    # Six layers: transformers' Gemma 3 pattern (every sixth global) has a global layer; window 8.
    "gemma3": lambda: make_arch_model("gemma3", num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=256),
}


def hf_greedy(model, prompt, n):
    model.generation_config.eos_token_id = None  # exactly n tokens, as ours without EOS ids
    model.generation_config.pad_token_id = 0
    return model.generate(prompt, max_new_tokens=n, do_sample=False)


def written(tmp_path, hf, **kwargs):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, **kwargs)
    return path


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_gguf_matches_transformers_reading_the_same_file(case, tmp_path):
    from transformers import AutoModelForCausalLM

    source = CASES[case]()
    path = written(tmp_path, source)
    ours = load_checkpoint(path, with_tokenizer=False).model
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    assert ours.config.architecture == type(theirs).__name__
    assert peek_config(path) == ours.config
    gen = torch.Generator().manual_seed(1)
    for length in (1, 7, 40):  # 40: past Gemma's window of 8
        x = torch.randint(0, source.config.vocab_size, (2, length), generator=gen)
        got, ref = ours(x), theirs(x).logits
        err, to_source = relative_error(got, ref), relative_error(got, source(x).logits)
        print(f"{case} T={length}: relative error to transformers {err:.2e}, to the source model {to_source:.2e}")
        assert err <= 1e-4 and to_source <= 1e-4
    prompt = torch.randint(0, source.config.vocab_size, (1, 6), generator=gen)
    assert torch.equal(ours.generate(prompt, 32), hf_greedy(theirs, prompt, 32))


@pytest.mark.parametrize("case, overrides", [
    ("qwen3", {"head_dim": 32}),  # not hidden / heads (16); transformers would build 128 and refuse the shapes
    ("qwen3-moe", {"moe_intermediate_size": 32}),  # transformers would build experts 768 wide
])
@torch.no_grad()
def test_gguf_keys_transformers_ignores_are_read(case, overrides, tmp_path):
    source = make_arch_model(case, num_hidden_layers=2, **overrides)
    ours = load_checkpoint(written(tmp_path, source), with_tokenizer=False).model
    x = torch.randint(0, source.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    err = relative_error(ours(x), source(x).logits)
    print(f"{case} {overrides}: relative error to the source model {err:.2e}")
    assert err <= 1e-4


def test_mixtral_gguf_is_refused(tmp_path):
    """llama.cpp writes Mixtral as a ``llama`` file with stacked experts; transformers reads it as a
    dense Llama and initialises the missing MLP at random, so there is nothing to match."""
    path = written(tmp_path, make_arch_model("mixtral", num_hidden_layers=2))
    with pytest.raises(CheckpointError, match="GGUF architecture 'llama' with 4 experts .*Mixtral.* not supported") as info:
        load_checkpoint(path, with_tokenizer=False)
    assert "\n" not in str(info.value)


def test_deepseek_gguf_is_refused(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "ds.gguf"), "deepseek2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="unsupported GGUF architecture 'deepseek2'; supported: llama, qwen2, qwen3, "
                                              "qwen3moe, gemma3") as info:
        load_checkpoint(tmp_path / "ds.gguf", with_tokenizer=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("case", ["qwen3", "gemma3"])
def test_gguf_rope_scaling_is_refused(case, tmp_path):
    path = written(tmp_path, CASES[case](), rope_scaling="yarn")
    with pytest.raises(CheckpointError, match="GGUF with rope scaling 'yarn' is not supported") as info:
        load_checkpoint(path, with_tokenizer=False)
    assert "\n" not in str(info.value)
