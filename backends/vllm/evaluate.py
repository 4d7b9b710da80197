"""Perplexity measured by a running vLLM server, by the shared protocol (``calib.protocol``).

Each evaluation window goes to ``POST /v1/completions`` as token ids with ``prompt_logprobs: 0``
and ``max_tokens: 1``: vLLM then returns, for every prompt position after the first, the log
probability of the token that is there, given the window's tokens before it. That is exactly what
``calib.perplexity`` sums for a local model (tokens 1..T-1 of each window, no context across
windows), so the two figures measure the same thing. With ``prompt_logprobs: k`` vLLM also returns
each position's k most likely tokens (``window_top_logprobs``), what ``qcompile eval --runtimes vllm``
compares with a reference.
"""
from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import torch

from calib.kl_divergence import TopLogProbs
from compiler.errors import QCompileError


class ServerEvalError(QCompileError):
    """The server's answer holds no usable prompt log-probabilities."""


def prompt_logprobs(url: str, model: str, window: list[int], top: int = 0, timeout_s: float = 600.0) -> list[dict]:
    """vLLM's prompt log-probabilities of ``window`` from the server at ``url`` (HOST:PORT): for tokens
    1..T-1, ``{token id: log-probability}`` of the token there and of the ``top`` most likely (vLLM
    returns at most its ``--max-logprobs``)."""
    body = {"model": model, "prompt": window, "max_tokens": 1, "temperature": 0, "prompt_logprobs": top}
    request = urllib.request.Request(f"http://{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            choice = json.load(response)["choices"][0]
    except urllib.error.HTTPError as e:  # vLLM says why in the body
        raise ServerEvalError(f"the server at {url} refused the request ({e.code}): {e.read().decode(errors='replace')[:300]}") from None
    except OSError as e:  # refused, reset, timed out: the server died or hangs
        raise ServerEvalError(f"no answer from the server at {url}: {getattr(e, 'reason', e)}") from None
    entries = choice.get("prompt_logprobs") or []
    if len(entries) != len(window):
        raise ServerEvalError(f"the server returned {len(entries)} prompt log-probabilities for {len(window)} tokens; "
                              "it must support vLLM's prompt_logprobs")
    out = []
    for token, entry in zip(window[1:], entries[1:]):
        logprobs = {int(t): (value or {}).get("logprob") for t, value in (entry or {}).items()}
        if token not in logprobs or not all(v is not None and math.isfinite(v) for v in logprobs.values()):
            raise ServerEvalError(f"no finite log-probability for prompt token {token}: {str(entry)[:120]}")
        out.append(logprobs)
    return out


def window_logprobs(url: str, model: str, window: list[int], timeout_s: float = 600.0) -> list[float]:
    """Log-probabilities of tokens 1..T-1 of ``window`` as the server at ``url`` (HOST:PORT) computes them."""
    return [float(logprobs[token]) for token, logprobs in zip(window[1:], prompt_logprobs(url, model, window, 0, timeout_s))]


def window_top_logprobs(url: str, model: str, window: list[int], top: int) -> TopLogProbs:
    """The server's ``top`` most likely tokens at tokens 1..T-1 of ``window``, with the target's, as
    ``calib.kl_divergence`` reads a runtime that returns no more (``-1`` pads rows of ``top`` tokens)."""
    entries = prompt_logprobs(url, model, window, top)
    width = max(len(e) for e in entries)
    tokens = torch.full((len(entries), width), -1, dtype=torch.int64)
    log_probs = torch.full((len(entries), width), -math.inf, dtype=torch.float64)
    for row, entry in enumerate(entries):
        tokens[row, :len(entry)] = torch.tensor(list(entry))
        log_probs[row, :len(entry)] = torch.tensor(list(entry.values()), dtype=torch.float64)
    targets = torch.tensor([entry[token] for token, entry in zip(window[1:], entries)], dtype=torch.float64)
    return TopLogProbs(tokens, log_probs, targets)


def server_perplexity(url: str, model: str, windows: torch.Tensor) -> dict:
    """``{"ppl", "tokens", "nll"}`` of the served model on ``windows`` [N, T], as ``calib.perplexity`` defines them."""
    total, count = 0.0, 0
    for window in windows.tolist():
        logprobs = window_logprobs(url, model, window)
        total -= sum(logprobs)
        count += len(logprobs)
    nll = total / count
    return {"ppl": math.exp(nll), "tokens": count, "nll": nll}
