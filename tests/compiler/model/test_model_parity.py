"""Our decoder against transformers: logits within 1e-4 relative (fp32), greedy decoding identical."""
import pytest
import torch
from conftest import make_hf_model
from numerics import relative_error

from compiler.io.load import load_checkpoint

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "llama-mha-bias": ("llama", {"num_key_value_heads": 4, "attention_bias": True}),
    "mistral-sliding": ("mistral", {"sliding_window": 8}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
}


def hf_greedy(model, prompt, n):
    model.generation_config.eos_token_id = None  # generate exactly n tokens, as ours does without EOS ids
    model.generation_config.pad_token_id = 0
    return model.generate(prompt, max_new_tokens=n, do_sample=False)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_match_transformers(case, tmp_path):
    arch, overrides = CASES[case]
    hf = make_hf_model(arch, **overrides)
    hf.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path).model
    gen = torch.Generator().manual_seed(1)
    for length in (1, 7, 40):
        x = torch.randint(0, hf.config.vocab_size, (2, length), generator=gen)
        with torch.no_grad():
            ref, got = hf(x).logits, ours(x)
        assert torch.isfinite(got).all()
        err = relative_error(got, ref)
        assert err < 1e-4, f"{case} T={length}: relative error {err:.2e}"
    prompt = torch.randint(0, hf.config.vocab_size, (1, 6), generator=gen)
    assert torch.equal(hf_greedy(hf, prompt, 32), ours.generate(prompt, 32))


def test_batched_cache_generation_equals_single(tmp_path):
    hf = make_hf_model("llama")
    hf.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path).model
    prompts = torch.randint(0, 128, (3, 5), generator=torch.Generator().manual_seed(2))
    batched = ours.generate(prompts, 16)
    for i in range(3):
        assert torch.equal(batched[i : i + 1], ours.generate(prompts[i : i + 1], 16))


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2):
    from transformers import AutoModelForCausalLM

    from compiler.io.checkpoint import resolve_model_path

    path = resolve_model_path("smollm2")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([smollm2.tokenizer("def quicksort(items):\n    ")["input_ids"]])
    x = torch.cat([ids, torch.randint(0, 49152, (1, 50), generator=torch.Generator().manual_seed(0))], dim=1)
    with torch.no_grad():
        err = relative_error(smollm2.model(x), hf(x).logits)
    assert err < 1e-4, f"SmolLM2 relative error {err:.2e}"
    assert torch.equal(hf_greedy(hf, ids, 32), smollm2.model.generate(ids, 32))
