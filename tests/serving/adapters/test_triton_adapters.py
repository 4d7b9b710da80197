"""The Triton adapters' request building and response parsing (no server; the server tests run them for real)."""
from __future__ import annotations

from serving.adapters.triton_common import event_from_fields, request_fields
from serving.adapters.triton_grpc import _inputs
from serving.adapters.triton_http import _error_text
from serving.types import SamplingParams


def test_request_fields_text_and_ids():
    params = SamplingParams(max_tokens=5, seed=3, stop=("\n",), ignore_eos=True)
    text = request_fields("hi", params, stream=True)
    assert text["text_input"] == "hi" and "input_ids" not in text and text["seed"] == 3 and text["stop"] == ["\n"]
    ids = request_fields([1, 2, 3], SamplingParams(), stream=False)
    assert ids["input_ids"] == [1, 2, 3] and "text_input" not in ids and "seed" not in ids and ids["stream"] is False


def test_grpc_inputs_are_typed():
    by_name = {t.name(): t for t in _inputs(request_fields([4, 5], SamplingParams(max_tokens=2), stream=True))}
    assert by_name["input_ids"].datatype() == "INT32" and by_name["input_ids"].shape() == [2]
    assert by_name["max_tokens"].datatype() == "INT32" and by_name["stream"].datatype() == "BOOL"
    assert by_name["temperature"].datatype() == "FP32"


def test_events_from_grpc_and_http_shapes():
    grpc = event_from_fields([b"ab"], [7, 8], [b""])
    assert (grpc.token_ids, grpc.text, grpc.finish_reason) == ([7, 8], "ab", None)
    http_last = event_from_fields("c", 9, "length")  # JSON turns a one-element array into a scalar
    assert (http_last.token_ids, http_last.text, http_last.finish_reason) == ([9], "c", "length")


def test_http_error_text():
    assert _error_text('{"error": "bad"}', 400) == "bad"
    assert _error_text('data: {"error": "max_tokens too big"}\n\n', 400) == "max_tokens too big"
    assert _error_text("<html>", 502).startswith("HTTP 502")
