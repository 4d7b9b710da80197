"""Qwen3, Gemma 3, Qwen3-MoE and Mixtral against transformers, through our loader from a saved HF
checkpoint: logits within 1e-4 relative (fp32) and 32 identical greedy tokens."""
import pytest
import torch
from arch_helpers import ARCH_CASES, make_arch_model
from numerics import relative_error
from test_model_parity import hf_greedy

from compiler.io.load import load_checkpoint


@pytest.mark.parametrize("case", sorted(ARCH_CASES))
def test_logits_and_greedy_match_transformers(case, tmp_path):
    hf = make_arch_model(case)
    hf.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path, with_tokenizer=False).model
    assert ours.config.architecture == hf.config.architectures[0]
    gen = torch.Generator().manual_seed(1)
    for length in (1, 7, 40):  # 40 > the sliding windows of 8
        x = torch.randint(0, hf.config.vocab_size, (2, length), generator=gen)
        with torch.no_grad():
            ref, got = hf(x).logits, ours(x)
        assert torch.isfinite(got).all()
        err = relative_error(got, ref)
        assert err < 1e-4, f"{case} T={length}: relative error {err:.2e}"
    prompt = torch.randint(0, hf.config.vocab_size, (1, 6), generator=gen)
    assert torch.equal(hf_greedy(hf, prompt, 32), ours.generate(prompt, 32))
