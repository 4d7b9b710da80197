"""llama.cpp's KL-divergence statistics (calib.kl_divergence) against a direct float64 computation."""
import math

import numpy as np
import pytest
import torch

from calib import kl_divergence
from calib.kl_divergence import KLDivergence, LogitsReference, TopLogProbs, encode_compact


def random_logits(n=700, vocab=64, seed=0, noise=0.5):
    """Reference logits, a candidate near them, and targets drawn from the reference (so the
    statistics are not all noise). Nothing is more than 16 nats below its row's top."""
    gen = torch.Generator().manual_seed(seed)
    ref = 2 * torch.randn(n, vocab, generator=gen)
    cand = ref + noise * torch.randn(n, vocab, generator=gen)
    targets = torch.multinomial(torch.softmax(ref, -1), 1, generator=gen)[:, 0]
    return ref, cand, targets


def direct(ref, cand, targets):
    """The statistics straight from their definitions, in float64, over all positions at once."""
    log_p, log_q = torch.log_softmax(ref.double(), -1), torch.log_softmax(cand.double(), -1)
    assert (log_p > -16).all()  # llama.cpp's cut leaves nothing out here
    kld = (log_p.exp() * (log_p - log_q)).sum(-1).numpy()
    nll_q = -log_q.gather(1, targets[:, None])[:, 0].numpy()
    nll_p = -log_p.gather(1, targets[:, None])[:, 0].numpy()
    dp = np.exp(-nll_q) - np.exp(-nll_p)
    same = (ref.argmax(-1) == cand.argmax(-1)).double().mean().item()
    n = len(kld)
    standard_error = lambda x: np.std(x) / math.sqrt(n - 1)  # noqa: E731  llama.cpp's: population variance / (n - 1)
    return {
        "ppl": math.exp(nll_q.mean()), "ppl_base": math.exp(nll_p.mean()),
        "ppl_uncertainty": math.exp(nll_q.mean()) * standard_error(nll_q),
        "ln_ppl_ratio": nll_q.mean() - nll_p.mean(), "ln_ppl_ratio_uncertainty": standard_error(nll_q - nll_p),
        "ln_ppl_correlation": np.corrcoef(nll_q, nll_p)[0, 1],
        "kld_mean": kld.mean(), "kld_mean_uncertainty": standard_error(kld),
        "kld_max": kld.max(), "kld_min": kld.min(),
        **{name: np.quantile(kld, q) for name, q in kl_divergence.PERCENTILES.items()},
        "rms_dp": math.sqrt((dp**2).mean()), "dp_mean": dp.mean(),
        "same_top": same, "same_top_uncertainty": math.sqrt(same * (1 - same) / (n - 1)),
        "tokens": n,
    }


def accumulate(reference_of, ref, cand, targets, windows=7):
    """The statistics added window by window, as an evaluation streams them."""
    stats = KLDivergence()
    for idx in torch.arange(len(ref)).chunk(windows):
        stats.add(reference_of(ref[idx], targets[idx]), cand[idx], targets[idx])
    return stats


def test_statistics_match_a_direct_float64_computation(monkeypatch):
    monkeypatch.setattr(kl_divergence, "CHUNK_ELEMENTS", 64 * 30)  # several row chunks per window
    ref, cand, targets = random_logits()
    stats = accumulate(LogitsReference, ref, cand, targets)
    got, want = stats.result(), direct(ref, cand, targets)
    assert 0.3 < want["same_top"] < 0.95 and want["kld_mean"] > 0.01  # a candidate neither equal nor unrelated
    for key, value in want.items():
        # percentiles, max and min come from the float32 per-token vector
        rel = 1e-6 if key.startswith("kld_") and key not in ("kld_mean", "kld_mean_uncertainty") else 1e-9
        assert got[key] == pytest.approx(value, rel=rel), key
    assert got["ppl_ratio"] == pytest.approx(math.exp(want["ln_ppl_ratio"]), rel=1e-9)
    assert got["ppl_diff"] == pytest.approx(want["ppl"] - want["ppl_base"], rel=1e-9)
    assert got["kld_min"] <= got["kld_median"] <= got["kld_90"] <= got["kld_95"] <= got["kld_99"] <= got["kld_max"]
    np.testing.assert_allclose(stats.token_kld(), (torch.log_softmax(ref.double(), -1).exp() * (
        torch.log_softmax(ref.double(), -1) - torch.log_softmax(cand.double(), -1))).sum(-1).numpy(), rtol=1e-6)


def test_candidate_equal_to_reference_gives_zero_divergence():
    ref, _, targets = random_logits()
    got = accumulate(LogitsReference, ref, ref.clone(), targets).result()
    assert got["kld_mean"] == 0 and got["kld_max"] == 0 and got["kld_min"] == 0
    assert got["same_top"] == 1 and got["same_top_uncertainty"] == 0
    assert got["rms_dp"] == 0 and got["rms_dp_uncertainty"] == 0
    assert got["ln_ppl_ratio"] == 0 and got["ln_ppl_ratio_uncertainty"] == 0 and got["ppl"] == got["ppl_base"]
    assert got["ln_ppl_correlation"] == pytest.approx(1)


def test_reference_tokens_16_nats_down_do_not_count():
    """llama.cpp's cut: reference tokens with ln p <= -16 are left out of the KLD."""
    ref = torch.tensor([[0.0, 0.0, -40.0]])
    cand = torch.tensor([[0.0, 0.0, 5.0]])
    stats = KLDivergence()
    stats.add(LogitsReference(ref, torch.tensor([0])), cand, torch.tensor([0]))
    log_p, log_q = torch.log_softmax(ref.double(), -1), torch.log_softmax(cand.double(), -1)
    assert stats.token_kld()[0] == pytest.approx(float((log_p.exp() * (log_p - log_q))[0, :2].sum()), rel=1e-6)


def test_compact_logits_hold_the_stated_precision():
    ref, _, targets = random_logits(vocab=256)
    ref[:5, :10] -= 30  # some logits far below the top: not stored
    compact = encode_compact(ref, targets)
    assert compact.codes.dtype == torch.uint16 and compact.scale.dtype == torch.float32
    rows = compact.rows(0, len(compact))
    exact = torch.log_softmax(ref.double(), -1)
    stored = exact >= exact.max(-1, keepdim=True).values - 16
    assert (rows.log_probs - exact)[stored].abs().max() < 1.3e-4  # half a step of 16/65535, and float32 rounding
    assert (rows.log_probs[~stored] <= -16).all()  # the floor: left out of the KLD
    assert torch.equal(rows.top_tokens, ref.argmax(-1))
    assert torch.allclose(rows.target_log_probs, exact.gather(1, targets[:, None])[:, 0], rtol=1e-6, atol=0)


def test_compact_reference_gives_the_live_statistics():
    ref, cand, targets = random_logits()
    live = accumulate(LogitsReference, ref, cand, targets).result()
    compact = accumulate(encode_compact, ref, cand, targets).result()
    for key, value in live.items():
        if key.startswith("kld"):  # from the 16-bit log-probs: 1.3e-4 nats each
            assert compact[key] == pytest.approx(value, abs=5e-4), key
        else:  # the target's log-prob and the top token are stored exactly
            assert compact[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key


@pytest.mark.parametrize("which", ["candidate", "reference"])
def test_nan_logits_raise(which):
    ref, cand, targets = random_logits(n=50)
    (cand if which == "candidate" else ref)[7, 3] = float("nan")
    with pytest.raises(FloatingPointError, match=f"the {which} model produced NaN or Inf logits"):
        accumulate(LogitsReference, ref, cand, targets)


# -- a candidate that returns only its top-k and the target (a server's prompt log-probabilities) --


def accumulate_top(reference_of, ref, cand, targets, k, windows=7):
    """The statistics of ``cand`` as a runtime returning its top ``k`` tokens and the target gives them."""
    stats = KLDivergence()
    for idx in torch.arange(len(ref)).chunk(windows):
        stats.add(reference_of(ref[idx], targets[idx]), TopLogProbs.from_logits(cand[idx], targets[idx], k), targets[idx])
    return stats


def full_kl(ref, cand):
    """KL(p_base ‖ q) over the whole vocabulary, no cut, per position."""
    log_p, log_q = torch.log_softmax(ref.double(), -1), torch.log_softmax(cand.double(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@pytest.mark.parametrize("sharpness", [1.0, 4.0])  # flat rows, and peaked ones (tokens below the cut among them)
def test_top_k_kld_is_a_lower_bound_and_the_rest_exact(monkeypatch, sharpness):
    monkeypatch.setattr(kl_divergence, "CHUNK_ELEMENTS", 64 * 30)  # several row chunks per window
    ref, cand, targets = random_logits(noise=0.8)
    ref, cand = sharpness * ref, sharpness * cand
    full = accumulate(LogitsReference, ref, cand, targets)
    full_kld = full.token_kld().astype(np.float64)  # llama.cpp's, with its cut at ln p_base = -16
    if sharpness == 1:
        np.testing.assert_allclose(full_kld, full_kl(ref, cand).numpy(), rtol=1e-6)  # nothing below the cut
    previous = np.full(len(ref), -np.inf)
    for k in (1, 5, 20, 63):
        top = accumulate_top(LogitsReference, ref, cand, targets, k)
        token_kld = top.token_kld().astype(np.float64)
        assert (token_kld <= full_kld + 1e-6).all(), k  # a lower bound, position by position
        assert (token_kld >= previous - 1e-6).all(), k  # a finer partition bounds no lower
        previous = token_kld
        got, want = top.result(), full.result()
        for key in ("ppl", "ppl_base", "ln_ppl_ratio", "rms_dp", "dp_mean", "same_top", "ln_ppl_correlation"):
            assert got[key] == pytest.approx(want[key], rel=1e-9), (k, key)  # exact from the top-k and the target
    assert 0.3 * full_kld.mean() < previous.mean() <= full_kld.mean()


def test_top_k_of_the_whole_vocabulary_is_the_full_kld():
    ref, cand, targets = random_logits(vocab=48)
    full = accumulate(LogitsReference, ref, cand, targets).result()
    top = accumulate_top(LogitsReference, ref, cand, targets, k=48).result()
    for key, value in full.items():
        assert top[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key


def test_top_k_kld_against_a_compact_reference():
    """A reference file's 16-bit log-probs: the rest's mass is summed over its tokens, not taken as 1 - Σ p."""
    ref, cand, targets = random_logits(vocab=256)
    ref, cand = 3 * ref, 3 * cand  # peaked: the rest holds little mass, where 1 - Σ p would be all rounding
    live = accumulate_top(LogitsReference, ref, cand, targets, k=10).result()
    compact = accumulate_top(encode_compact, ref, cand, targets, k=10).result()
    assert compact["kld_mean"] == pytest.approx(live["kld_mean"], abs=5e-4)
    assert compact["kld_99"] == pytest.approx(live["kld_99"], abs=5e-4)
