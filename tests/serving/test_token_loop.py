"""The engine's request (``serving/request.py``) and the adapters' token stream (``serving/adapters/_stream.py``,
ONNX Runtime and Ascend) turn the same sampled tokens into the same stream: text deltas, token ids and
finish reason, with stop strings, EOS and the token budget."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from serving.adapters._stream import TokenStream
from serving.request import Request
from serving.types import SamplingParams

VOCAB = ["<eos>", "a", "\n", "b", "c", "é"[:1], "xy", "\n\n"]
EOS = 0


class CharTokenizer:
    """Token i decodes to VOCAB[i]; EOS is special (skipped)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i == EOS))


def collect(events) -> tuple[str, list[int], str, list[str]]:
    """What the client receives up to the finishing event: text, token ids, finish reason, the deltas."""
    deltas, ids = [], []
    for event in events:
        deltas.append(event.text)
        ids += event.token_ids
        if event.finish_reason:
            return "".join(deltas), ids, event.finish_reason, deltas
    raise AssertionError("the stream never finished")


def through_engine_request(tokens: list[int], params: SamplingParams) -> tuple[str, list[int], str, list[str]]:
    request = Request("r", [1], params, [EOS], CharTokenizer(), torch.device("cpu"), 0)
    return collect(request.append_token(token) for token in tokens)


def one_hot(token: int) -> np.ndarray:
    logits = np.full(len(VOCAB), -1e9, dtype=np.float32)
    logits[token] = 0.0  # greedy picks exactly this token
    return logits


def through_adapter_stream(tokens: list[int], params: SamplingParams) -> tuple[str, list[int], str, list[str]]:
    stream = TokenStream([1], params, CharTokenizer(), [EOS], max_len=64)
    return collect(stream.next(one_hot(token)) for token in tokens)


CASES = {
    # the stop string spans two tokens: neither half reaches the client
    "stop across tokens": ([1, 2, 2, 3], SamplingParams(max_tokens=8, stop=("\n\n",)), "a"),
    "stop in one token": ([1, 7, 3], SamplingParams(max_tokens=8, stop=("\n\n",)), "a"),
    "a stop prefix that turns out not to be one": ([1, 2, 3, 0], SamplingParams(max_tokens=8, stop=("\n\n",)), "a\nb"),
    "stop inside a token": ([3, 6, 4], SamplingParams(max_tokens=8, stop=("y",)), "bx"),
    "eos": ([1, 3, 0, 4], SamplingParams(max_tokens=8), "ab"),
    "eos ignored": ([1, 0, 3], SamplingParams(max_tokens=3, ignore_eos=True), "ab"),
    "token budget": ([1, 3, 4, 1], SamplingParams(max_tokens=3), "abc"),
    "budget with a held-back stop prefix": ([1, 3, 2], SamplingParams(max_tokens=3, stop=("\n\n",)), "ab\n"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_engine_and_adapters_stream_the_same(name):
    tokens, params, text = CASES[name]
    engine = through_engine_request(tokens, params)
    adapter = through_adapter_stream(tokens, params)
    print(name, engine, adapter)
    assert engine[0] == text, "the engine's text"
    assert adapter[:3] == engine[:3]  # text, token ids (EOS counted by both), finish reason
    assert adapter[3] == engine[3]  # and the same deltas, event by event
