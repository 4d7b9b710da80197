"""How far a candidate model's next-token distributions are from a reference's: llama.cpp's
KL-divergence statistics (``llama-perplexity --kl-divergence``), accumulated window by window.

The definitions follow llama.cpp's tools/perplexity/perplexity.cpp (``kl_divergence``,
``log_softmax`` with a ``kl_divergence_result``, ``mean_and_uncertainty``, ``covariance``,
``percentile``), for every scored position (target token t, base = reference, Q = candidate):

    nll          -ln p(t); PPL = exp(mean nll), ± PPL · uncertainty of the mean nll
    ln ratio     mean nll_Q - mean nll_base = ln(PPL(Q)/PPL(base)), ± from both means' uncertainties
                 and their covariance
    KLD          sum over the vocabulary of p_base · (ln p_base - ln p_Q), over the tokens whose
                 ln p_base > -16 (llama.cpp's cut; a reference file stores nothing below it)
    Δp           p_Q(t) - p_base(t); RMS Δp = sqrt(mean Δp²), ± from the uncertainty of mean Δp²
    same top     the share of positions where both models' most likely token is the same,
                 ± sqrt(p(1-p)/(n-1))

The uncertainty of a mean is llama.cpp's: the standard error sqrt(var/(n-1)), 0 for 10 positions
or fewer. Sums are float64; one float32 KLD per position is kept for the percentiles (a few
bytes per token, never the logits). A non-finite result raises ``FloatingPointError``.

``CompactLogits`` is llama.cpp's compact form of reference logits (``--kl-divergence-base``).

A candidate that returns only some tokens' log-probabilities per position (a server's top-k with
the target: ``TopLogProbs``) gets the same statistics from what it returns. NLL, PPL, Δp and same
top are exact (the top token is in every top-k, the target is returned). The KLD is the KL
divergence between the two distributions collapsed onto the cells {each returned token whose
ln p_base > -16} and {every other token}:

    KLD_top = Σ_{j returned, ln p_base(j) > -16} p_j · (ln p_j - ln q_j) + p_rest · (ln p_rest - ln q_rest)
    p_rest  = Σ of p_base over the other tokens with ln p_base > -16 (the cut, as the full KLD's)
    q_rest  = 1 - Σ of the candidate's returned q_j over the same cells, at least ``REST_FLOOR``

By the log-sum inequality, Σ over the other kept tokens of p · ln(p / q) ≥ p_rest · ln(p_rest / Σ q)
≥ p_rest · ln(p_rest / q_rest) (their q sum to at most q_rest), so KLD_top is a lower bound of the
full KLD, position by position, with the same cut; equal to it when every kept token is returned.
Flooring q_rest only lowers it further.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

# llama.cpp: reference tokens with ln p <= -16 do not count in the KLD; the compact form keeps
# logits over [max - 16, max] only.
KLD_LOG_PROB_FLOOR = -16.0
COMPACT_RANGE = 16.0
COMPACT_LEVELS = 65535  # uint16 codes 0..65535
PERCENTILES = {"kld_99_9": 0.999, "kld_99": 0.99, "kld_95": 0.95, "kld_90": 0.90, "kld_median": 0.5}
# Rows processed at once: log-probs in float64 for about this many vocabulary entries (32 MiB each).
CHUNK_ELEMENTS = 1 << 22
# The least candidate mass of the tokens a top-k runtime did not return: returned log-probs are float32,
# whose probabilities sum to 1 within about 1e-6, so 1 - their sum is not resolved below that.
REST_FLOOR = 1e-6


@dataclass
class ReferenceRows:
    """The reference at some scored positions, as the statistics read it."""

    log_probs: torch.Tensor  # [n, V] float64 ln p_base (entries <= -16 may be approximate: they are not used)
    target_log_probs: torch.Tensor  # [n] float64 ln p_base(target)
    top_tokens: torch.Tensor  # [n] the reference's most likely token


class Reference(Protocol):
    """Reference distributions at ``len()`` scored positions, read a slice of rows at a time."""

    def __len__(self) -> int: ...

    def rows(self, start: int, stop: int) -> ReferenceRows: ...


@dataclass
class LogitsReference:
    """A reference model's logits [N, V] at N scored positions, with their target tokens [N]."""

    logits: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return len(self.logits)

    def rows(self, start: int, stop: int) -> ReferenceRows:
        logits = self.logits[start:stop]
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        target = log_probs.gather(1, self.targets[start:stop, None].to(logits.device))[:, 0]
        return ReferenceRows(log_probs, target, logits.argmax(dim=-1))


@dataclass
class CompactLogits:
    """llama.cpp's compact reference logits: its ``log_softmax(n_vocab, logits, uint16_t * log_prob, tok)``
    in tools/perplexity/perplexity.cpp, which ``process_logits`` writes for ``--kl-divergence-base``.

    Per position, the logits over [max - 16, max] are ``COMPACT_LEVELS`` even steps (``codes``,
    uint16, 0 for everything at or below the bottom), ``scale`` is the step and ``min_log_prob``
    the log-probability of code 0 (the log-sum-exp folded in, as llama.cpp does):
    ln p = scale · code + min_log_prob. Precision: half a step, 16/65535/2 = 1.2e-4 nats, plus
    float32 rounding of ``min_log_prob`` (about 2e-6), for every token within 16 nats of the top;
    tokens further down are not stored (p < e^-16 · p_top), which the KLD's cut at ln p = -16 leaves
    out anyway. Beyond llama.cpp, the target token's log-probability (float32) and the top token
    are stored exactly: llama.cpp reads them from the codes, so a target more than 16 nats below the
    top reads as the bottom and PPL(base) comes out wrong (ik_llama.cpp PR #325, "Fix KLD precision").
    """

    codes: torch.Tensor  # [N, V] uint16
    scale: torch.Tensor  # [N] float32
    min_log_prob: torch.Tensor  # [N] float32
    target_log_probs: torch.Tensor  # [N] float32
    top_tokens: torch.Tensor  # [N] int32

    def __len__(self) -> int:
        return len(self.codes)

    def rows(self, start: int, stop: int) -> ReferenceRows:
        codes = self.codes[start:stop].double()
        log_probs = codes * self.scale[start:stop, None].double() + self.min_log_prob[start:stop, None].double()
        return ReferenceRows(log_probs, self.target_log_probs[start:stop].double(), self.top_tokens[start:stop].long())


@dataclass
class TopLogProbs:
    """A candidate's log-probabilities of a few tokens at N scored positions (a server's top-k and
    the target), where it returns no more."""

    tokens: torch.Tensor  # [N, m] int64 token ids, distinct within a row; -1 pads a row that has fewer
    log_probs: torch.Tensor  # [N, m] ln q of those tokens (-inf where padded)
    target_log_probs: torch.Tensor  # [N] ln q(target)

    def __len__(self) -> int:
        return len(self.tokens)

    def rows(self, start: int, stop: int) -> "TopLogProbs":
        return TopLogProbs(self.tokens[start:stop], self.log_probs[start:stop], self.target_log_probs[start:stop])

    @staticmethod
    def from_logits(logits: torch.Tensor, targets: torch.Tensor, k: int) -> "TopLogProbs":
        """What a runtime returning the top ``k`` and the target would give for ``logits`` [N, V]."""
        log_q = torch.log_softmax(logits.double(), dim=-1)
        top = log_q.topk(k, dim=-1).indices
        target_in_top = (top == targets[:, None]).any(dim=-1, keepdim=True)
        tokens = torch.cat([top, torch.where(target_in_top, -1, targets[:, None])], dim=1)
        log_probs = torch.where(tokens >= 0, log_q.gather(1, tokens.clamp_min(0)), -math.inf)
        return TopLogProbs(tokens, log_probs, log_q.gather(1, targets[:, None])[:, 0])

    @staticmethod
    def concat(parts: "list[TopLogProbs]") -> "TopLogProbs":
        """The positions of ``parts`` in order, rows padded to the widest."""
        width = max(part.tokens.shape[1] for part in parts)

        def pad(x: torch.Tensor, value: float) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

        return TopLogProbs(torch.cat([pad(p.tokens, -1) for p in parts]), torch.cat([pad(p.log_probs, -math.inf) for p in parts]),
                           torch.cat([p.target_log_probs for p in parts]))


def encode_compact(logits: torch.Tensor, targets: torch.Tensor) -> CompactLogits:
    """``logits`` [N, V] at N scored positions and their targets [N] in llama.cpp's compact form."""
    step = _chunk_rows(logits)
    parts = [_encode_rows(logits[start:start + step], targets[start:start + step]) for start in range(0, len(logits), step)]
    return CompactLogits(*(torch.cat(column) for column in zip(*parts)))


def _encode_rows(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    logits = logits.double()
    top = logits.max(dim=-1, keepdim=True).values
    bottom = torch.maximum(logits.min(dim=-1, keepdim=True).values, top - COMPACT_RANGE)
    log_sum_exp = torch.logsumexp(logits - top, dim=-1, keepdim=True)
    scale = ((top - bottom) / COMPACT_LEVELS).float()  # the stored step; codes are rounded against it
    steps = torch.where(scale > 0, (logits - bottom) / scale.double().clamp_min(1e-30), 0.0)
    codes = steps.round().clamp(0, COMPACT_LEVELS).to(torch.int32).to(torch.uint16)
    log_probs_of_targets = logits.gather(1, targets[:, None].to(logits.device)) - top - log_sum_exp
    return (codes.cpu(), scale[:, 0].cpu(), (bottom - top - log_sum_exp)[:, 0].float().cpu(),
            log_probs_of_targets[:, 0].float().cpu(), logits.argmax(dim=-1).to(torch.int32).cpu())


def _chunk_rows(logits: torch.Tensor) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1]))


def top_kld(ref_log_p: torch.Tensor, top: TopLogProbs) -> torch.Tensor:
    """KLD_top of each row (module docstring): ``ref_log_p`` [n, V] float64, ``top`` the candidate's n rows."""
    tokens = top.tokens.to(ref_log_p.device)
    log_q = top.log_probs.to(ref_log_p.device).double()
    ref_at = ref_log_p.gather(1, tokens.clamp_min(0))
    own = (tokens >= 0) & (ref_at > KLD_LOG_PROB_FLOOR)  # the cells of their own
    head = torch.where(own, ref_at.exp() * (ref_at - log_q), 0.0).sum(dim=-1)
    # p_rest summed over the tokens themselves, not as 1 - Σ p: no cancellation when the head holds nearly all
    in_own = torch.zeros_like(ref_log_p).scatter_add_(1, tokens.clamp_min(0), own.double()) > 0
    p_rest = torch.where((ref_log_p > KLD_LOG_PROB_FLOOR) & ~in_own, ref_log_p.exp(), 0.0).sum(dim=-1)
    q_rest = (1 - torch.where(own, log_q.exp(), 0.0).sum(dim=-1)).clamp_min(REST_FLOOR)
    rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-300).log() - q_rest.log()), 0.0)
    return head + rest


class KLDivergence:
    """Accumulates llama.cpp's statistics over scored positions; ``add`` a batch, then ``result()``."""

    SUMS = ("nll", "nll2", "nll_base", "nll_base2", "nll_nll_base", "kld", "kld2", "dp", "dp2", "dp4", "same_top")

    def __init__(self):
        self.sums = dict.fromkeys(self.SUMS, 0.0)  # float64 (Python floats)
        self.count = 0
        self._token_kld: list[np.ndarray] = []

    def add(self, reference: Reference, candidate: torch.Tensor | TopLogProbs, targets: torch.Tensor) -> None:
        """Positions where the candidate gave ``candidate`` — logits [N, V], or ``TopLogProbs`` of N
        positions — and the target tokens were ``targets`` [N]."""
        if len(reference) != len(candidate) or len(targets) != len(candidate):
            raise ValueError(f"{len(candidate)} candidate positions, {len(reference)} reference, {len(targets)} targets")
        step = _chunk_rows(candidate if isinstance(candidate, torch.Tensor) else reference.rows(0, 1).log_probs)
        for start in range(0, len(candidate), step):
            stop = min(start + step, len(candidate))
            if isinstance(candidate, TopLogProbs):
                self._add_top_rows(reference.rows(start, stop), candidate.rows(start, stop))
            else:
                self._add_rows(reference.rows(start, stop), candidate[start:stop], targets[start:stop])

    def _add_rows(self, ref: ReferenceRows, logits: torch.Tensor, targets: torch.Tensor) -> None:
        _check_finite(logits, "the candidate model produced NaN or Inf logits")
        log_q = torch.log_softmax(logits.double(), dim=-1)
        ref_log_p = ref.log_probs.to(log_q.device)
        kept = ref_log_p > KLD_LOG_PROB_FLOOR
        kld = torch.where(kept, ref_log_p.exp() * (ref_log_p - log_q), 0.0).sum(dim=-1)
        target_log_q = log_q.gather(1, targets.to(log_q.device)[:, None])[:, 0]
        self._accumulate(ref, target_log_q, kld, logits.argmax(dim=-1))

    def _add_top_rows(self, ref: ReferenceRows, top: TopLogProbs) -> None:
        _check_finite(top.target_log_probs, "the candidate model produced NaN or Inf log-probabilities")
        top_tokens = top.tokens.gather(1, top.log_probs.argmax(dim=-1, keepdim=True))[:, 0]
        self._accumulate(ref, top.target_log_probs.double(), top_kld(ref.log_probs.double(), top), top_tokens)

    def _accumulate(self, ref: ReferenceRows, target_log_q: torch.Tensor, kld: torch.Tensor,
                    top_tokens: torch.Tensor) -> None:
        """One chunk of positions: the candidate's ln q(target), KLD and most likely token at each."""
        _check_finite(ref.target_log_probs, "the reference model produced NaN or Inf logits")
        _check_finite(kld, "the KL divergence is not finite: the candidate gives a probability of 0 where the reference does not, or the reference holds NaN")
        device = kld.device
        nll = -target_log_q.to(device)
        nll_base = -ref.target_log_probs.to(device)
        dp = (-nll).exp() - (-nll_base).exp()
        same_top = top_tokens.to(device) == ref.top_tokens.to(device)
        for name, values in (("nll", nll), ("nll2", nll**2), ("nll_base", nll_base), ("nll_base2", nll_base**2),
                             ("nll_nll_base", nll * nll_base), ("kld", kld), ("kld2", kld**2), ("dp", dp),
                             ("dp2", dp**2), ("dp4", dp**4), ("same_top", same_top.double())):
            self.sums[name] += float(values.sum())
        self.count += len(nll)
        self._token_kld.append(kld.float().cpu().numpy())

    def token_kld(self) -> np.ndarray:
        """Every scored position's KLD (float32), in order."""
        return np.concatenate(self._token_kld) if self._token_kld else np.zeros(0, np.float32)

    def result(self) -> dict:
        """The statistics as a flat dict of floats (probabilities and Δp as fractions, not percent)."""
        if self.count == 0:
            raise ValueError("no positions were scored")
        s, n = self.sums, self.count
        ln_ppl, ln_ppl_unc = mean_and_uncertainty(s["nll"], s["nll2"], n)
        ln_base, ln_base_unc = mean_and_uncertainty(s["nll_base"], s["nll_base2"], n)
        cov = covariance(s["nll"], s["nll_base"], s["nll_nll_base"], n)
        ppl, ppl_base = math.exp(ln_ppl), math.exp(ln_base)
        ln_ratio = ln_ppl - ln_base
        # Rounding can leave the variance of a difference of near-identical runs a hair below 0.
        ln_ratio_unc = math.sqrt(max(0.0, ln_ppl_unc**2 + ln_base_unc**2 - 2 * cov))
        ppl_unc, ppl_base_unc = ppl * ln_ppl_unc, ppl_base * ln_base_unc
        kld, kld_unc = mean_and_uncertainty(s["kld"], s["kld2"], n)
        dp, dp_unc = mean_and_uncertainty(s["dp"], s["dp2"], n)
        mse_dp, mse_dp_unc = mean_and_uncertainty(s["dp2"], s["dp4"], n)
        rms_dp = math.sqrt(mse_dp)
        same_top = s["same_top"] / n
        token_kld = np.sort(self.token_kld().astype(np.float64))
        out = {
            "ppl": ppl, "ppl_uncertainty": ppl_unc,
            "ppl_base": ppl_base, "ppl_base_uncertainty": ppl_base_unc,
            # llama.cpp's Cor(ln(PPL(Q)), ln(PPL(base))); undefined (None) when either uncertainty is 0
            "ln_ppl_correlation": cov / (ln_ppl_unc * ln_base_unc) if ln_ppl_unc > 0 and ln_base_unc > 0 else None,
            "ln_ppl_ratio": ln_ratio, "ln_ppl_ratio_uncertainty": ln_ratio_unc,
            "ppl_ratio": math.exp(ln_ratio), "ppl_ratio_uncertainty": math.exp(ln_ratio) * ln_ratio_unc,
            "ppl_diff": ppl - ppl_base,
            "ppl_diff_uncertainty": math.sqrt(max(0.0, ppl_unc**2 + ppl_base_unc**2 - 2 * ppl * ppl_base * cov)),
            "kld_mean": kld, "kld_mean_uncertainty": kld_unc,
            "kld_max": float(token_kld[-1]),
            **{name: percentile(token_kld, q) for name, q in PERCENTILES.items()},
            "kld_min": float(token_kld[0]),
            "dp_mean": dp, "dp_mean_uncertainty": dp_unc,
            "rms_dp": rms_dp, "rms_dp_uncertainty": 0.5 / rms_dp * mse_dp_unc if rms_dp > 0 else 0.0,
            "same_top": same_top,
            "same_top_uncertainty": math.sqrt(same_top * (1 - same_top) / (n - 1)) if n > 1 else 0.0,
            "tokens": n,
        }
        bad = [k for k, v in out.items() if v is not None and not math.isfinite(v)]
        if bad:
            raise FloatingPointError(f"KL-divergence statistics are not finite ({', '.join(bad)}): "
                                     "a model produced NaN or Inf logits")
        return out


def mean_and_uncertainty(total: float, total_sq: float, count: int) -> tuple[float, float]:
    """llama.cpp's ``mean_and_uncertainty``: the mean and its standard error (0 for 10 values or fewer)."""
    mean = total / count
    var = total_sq / count - mean * mean
    return mean, math.sqrt(var / (count - 1)) if var > 0 and count > 10 else 0.0


def covariance(total_a: float, total_b: float, total_ab: float, count: int) -> float:
    """llama.cpp's ``covariance`` of two means (0 for fewer than 10 values)."""
    if count < 10:
        return 0.0
    return (total_ab / count - (total_a / count) * (total_b / count)) / (count - 1)


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama.cpp's ``percentile``: linear interpolation between the sorted values at fraction · (n - 1)."""
    position = fraction * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return float((1 - (position - low)) * sorted_values[low] + (position - low) * sorted_values[high])


def _check_finite(values: torch.Tensor, message: str) -> None:
    if not bool(torch.isfinite(values).all()):
        raise FloatingPointError(message)
