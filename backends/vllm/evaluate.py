"""Perplexity measured by a running vLLM server, by the shared protocol (``calib.protocol``).

Each evaluation window goes to ``POST /v1/completions`` as token ids with ``prompt_logprobs: 0``
and ``max_tokens: 1``: vLLM then returns, for every prompt position after the first, the log
probability of the token that is there, given the window's tokens before it. That is exactly what
``calib.perplexity`` sums for a local model (tokens 1..T-1 of each window, no context across
windows), so the two figures measure the same thing.
"""
from __future__ import annotations

import json
import math
import urllib.request

import torch

from compiler.errors import QCompileError


class ServerEvalError(QCompileError):
    """The server's answer holds no usable prompt log-probabilities."""


def window_logprobs(url: str, model: str, window: list[int], timeout_s: float = 600.0) -> list[float]:
    """Log-probabilities of tokens 1..T-1 of ``window`` as the server at ``url`` (HOST:PORT) computes them."""
    body = {"model": model, "prompt": window, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    request = urllib.request.Request(f"http://{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        choice = json.load(response)["choices"][0]
    entries = choice.get("prompt_logprobs") or []
    if len(entries) != len(window):
        raise ServerEvalError(f"the server returned {len(entries)} prompt log-probabilities for {len(window)} tokens; "
                              "it must support vLLM's prompt_logprobs")
    values = []
    for token, entry in zip(window[1:], entries[1:]):
        logprob = (entry or {}).get(str(token), {}).get("logprob")
        if logprob is None or not math.isfinite(logprob):
            raise ServerEvalError(f"no finite log-probability for prompt token {token}: {str(entry)[:120]}")
        values.append(float(logprob))
    return values


def server_perplexity(url: str, model: str, windows: torch.Tensor) -> dict:
    """``{"ppl", "tokens", "nll"}`` of the served model on ``windows`` [N, T], as ``calib.perplexity`` defines them."""
    total, count = 0.0, 0
    for window in windows.tolist():
        logprobs = window_logprobs(url, model, window)
        total -= sum(logprobs)
        count += len(logprobs)
    nll = total / count
    return {"ppl": math.exp(nll), "tokens": count, "nll": nll}
