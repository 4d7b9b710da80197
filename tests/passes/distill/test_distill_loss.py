"""Distillation loss terms against hand-computed values, and the projection path."""
import math

import pytest
import torch

from passes.distill.loss import (
    HiddenProjections,
    LossWeights,
    distill_loss,
    kl_per_token,
    next_token_ce,
)


def _hand_kl(pt_logits, ps_logits, T):
    pt = [math.exp(x / T) for x in pt_logits]
    ps = [math.exp(x / T) for x in ps_logits]
    pt = [x / sum(pt) for x in pt]
    ps = [x / sum(ps) for x in ps]
    return sum(a * math.log(a / b) for a, b in zip(pt, ps))


@pytest.mark.parametrize("T", [1.0, 2.0])
def test_kl_matches_hand_computation(T):
    t = torch.tensor([[[1.0, 2.0, 0.5], [0.0, 0.0, 3.0]]])
    s = torch.tensor([[[0.5, 2.5, 0.0], [1.0, -1.0, 2.0]]])
    got = kl_per_token(t, s, T)
    want = [_hand_kl(t[0, i].tolist(), s[0, i].tolist(), T) for i in range(2)]
    assert got.shape == (1, 2)
    assert got[0].tolist() == pytest.approx(want, rel=1e-5)
    assert kl_per_token(t, t, T).abs().max() < 1e-6  # KL of a distribution with itself


def test_ce_matches_hand_computation():
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 3.0], [9.0, 9.0, 9.0]]])
    ids = torch.tensor([[0, 1, 2]])
    # position 0 predicts ids[1] = 1, position 1 predicts ids[2] = 2; the last position predicts nothing
    want = (-math.log(1 / (math.exp(2) + 2)) - math.log(math.exp(3) / (1 + math.e + math.exp(3)))) / 2
    assert next_token_ce(logits, ids).item() == pytest.approx(want, rel=1e-6)


def test_total_loss_combines_weighted_terms():
    torch.manual_seed(0)
    ids = torch.randint(0, 5, (2, 4))
    t, s = torch.randn(2, 4, 5), torch.randn(2, 4, 5)
    th = [torch.randn(2, 4, 3) for _ in range(3)]
    sh = [torch.randn(2, 4, 3) for _ in range(2)]
    pairs = [(0, 1), (1, 2)]
    w = LossWeights(alpha=0.7, beta=0.3, gamma=0.2, temperature=2.0, hidden_norm="none")
    terms = distill_loss(w, ids, t, s, th, sh, pairs)
    kl = kl_per_token(t, s, 2.0).mean()
    mse = (((sh[0] - th[1]) ** 2).mean() + ((sh[1] - th[2]) ** 2).mean()) / 2
    ce = next_token_ce(s, ids)
    assert terms["kl"].item() == pytest.approx(kl.item(), rel=1e-6)
    assert terms["mse"].item() == pytest.approx(mse.item(), rel=1e-6)
    assert terms["ce"].item() == pytest.approx(ce.item(), rel=1e-6)
    assert terms["loss"].item() == pytest.approx((0.7 * 4 * kl + 0.3 * mse + 0.2 * ce).item(), rel=1e-6)


def test_rms_hidden_norm_compares_directions_per_token():
    torch.manual_seed(0)
    th = [torch.randn(2, 4, 3) * torch.tensor([1.0, 300.0, 1.0, 1.0])[None, :, None]]  # one massive token
    sh = [torch.randn(2, 4, 3)]
    terms = distill_loss(LossWeights(alpha=0, beta=1.0, hidden_norm="rms"), torch.zeros(2, 4, dtype=torch.long),
                         torch.zeros(2, 4, 5), torch.zeros(2, 4, 5), th, sh, [(0, 0)])

    def by_hand(h):  # each token divided by sqrt(mean of its squares)
        return h / (h ** 2).mean(-1, keepdim=True).sqrt()

    assert terms["mse"].item() == pytest.approx(((by_hand(sh[0]) - by_hand(th[0])) ** 2).mean().item(), rel=1e-5)
    # scale-invariant per token: rescaling one token of the student changes nothing
    sh_scaled = [sh[0] * torch.tensor([1.0, 7.0, 1.0, 0.5])[None, :, None]]
    again = distill_loss(LossWeights(alpha=0, beta=1.0, hidden_norm="rms"), torch.zeros(2, 4, dtype=torch.long),
                         torch.zeros(2, 4, 5), torch.zeros(2, 4, 5), th, sh_scaled, [(0, 0)])
    assert again["mse"].item() == pytest.approx(terms["mse"].item(), rel=1e-5)


def test_default_weights_are_the_recipe():
    w = LossWeights()
    assert (w.alpha, w.beta, w.gamma, w.temperature, w.hidden_norm) == (1.0, 0.1, 0.0, 1.0, "rms")


def test_projection_path_maps_student_width_and_learns():
    torch.manual_seed(0)
    proj = HiddenProjections(n_pairs=2, student_dim=3, teacher_dim=5)
    # initialised to a truncated identity: the shared dimensions are copied, the rest start at 0
    h = torch.randn(1, 2, 3)
    out = proj(0, h)
    assert out.shape == (1, 2, 5)
    torch.testing.assert_close(out[..., :3], h)
    assert out[..., 3:].abs().max() == 0
    th = [torch.randn(1, 2, 5), torch.randn(1, 2, 5)]
    sh = [h.clone().requires_grad_(), torch.randn(1, 2, 3, requires_grad=True)]
    terms = distill_loss(LossWeights(alpha=0, beta=1.0, hidden_norm="none"), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, 4),
                         torch.zeros(1, 2, 4), th, sh, [(0, 0), (1, 1)], proj)
    want = (((proj(0, sh[0]) - th[0]) ** 2).mean() + ((proj(1, sh[1]) - th[1]) ** 2).mean()) / 2
    assert terms["loss"].item() == pytest.approx(want.item(), rel=1e-6)
    terms["loss"].backward()
    assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in proj.maps)
    assert sh[0].grad is not None
