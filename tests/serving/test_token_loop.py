"""One token loop for every runtime: the same scripted token sequences, with stop strings, EOS, the
token budget and a client that leaves mid-stream, go through each runtime's real adapter (the
engine, ONNX Runtime one at a time and batched, Ascend, Triton's Python-backend model), and the
client receives the same events from each: text deltas, token ids, finish reason. A client that
leaves stops the generation and frees its request (KV blocks, cache row, session lock).

Under each adapter the model is a scripted double (``tests/runtime_doubles.py``): the logits of
each position pick the next token of the script, so every runtime sees the same logits.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np
import pytest
from runtime_doubles import (
    ScriptedLM,
    ScriptedModelRunner,
    ScriptedOmSession,
    ScriptedOnnxRunner,
    TritonRequest,
    load_triton_backend,
    triton_model_args,
    write_ascend_bundle,
)

import serving.adapters.ascend as ascend_module
import serving.adapters.onnx as onnx_module
from compiler.deploy.serving_plan import ServingPlan
from compiler.model.config import ModelConfig
from compiler.model.transformer import Transformer
from serving.adapters.ascend import AscendAdapter
from serving.adapters.engine import EngineAdapter
from serving.adapters.onnx import OnnxRuntimeAdapter
from serving.adapters.triton_common import event_from_fields
from serving.engine import Engine
from serving.request import Request
from serving.types import SamplingParams, StreamEvent

VOCAB = ["<eos>", "a", "\n", "b", "c", "é"[:1], "xy", "\n\n"]
EOS = 0
PROMPT = [1]


class CharTokenizer:
    """Token i decodes to VOCAB[i]; EOS is special (skipped)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i == EOS))


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
LONG = SamplingParams(max_tokens=40, ignore_eos=True)  # what a runtime that kept going would run to
# (script, params, events the client reads before it leaves)
ABORTS = {
    "client leaves mid-stream": ([1, 3, 4] * 14, LONG, 2),
    "client leaves while a stop prefix is held back": ([1, 2, 3] * 14, SamplingParams(max_tokens=40, stop=("\n\n",)), 2),
}


@dataclass
class Served:
    events: list[StreamEvent]  # what the client received
    forwards: int  # forwards (or decoded rows) the runtime ran for it, once it came to rest
    freed: bool  # nothing of the request is left in the runtime


def received(events: list[StreamEvent]) -> tuple[str, list[int], str | None, list[str]]:
    """What the client has: text, token ids, finish reason, the deltas."""
    return "".join(e.text for e in events), [t for e in events for t in e.token_ids], events[-1].finish_reason, \
        [e.text for e in events]


def through_request(script: list[int], params: SamplingParams) -> list[StreamEvent]:
    """The token loop itself (``serving.request.Request``) fed the script's tokens: the expected stream."""
    request = Request("r", PROMPT, params, [EOS], CharTokenizer())
    events = []
    for token in script:
        events.append(request.append_token(token))
        if request.finished:
            return events
    raise AssertionError("the script ends before the request does")


async def consume(stream, leave_after: int | None) -> list[StreamEvent]:
    """The client: reads the stream, or only its first ``leave_after`` events and then closes it."""
    events = []
    async for event in stream:
        events.append(event)
        if len(events) == leave_after:
            break
    await stream.aclose()
    return events


async def settle(count, still_running, timeout: float = 10.0) -> int:
    """Let the runtime run until ``still_running()`` is false and ``count()`` holds still; its count then
    (a forward in flight when the client left may still finish)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        if not still_running() and count() == last:
            return last
        last = count()
    raise AssertionError("the runtime kept running after the client left")


def scripted_engine(lm: ScriptedLM) -> Engine:
    """A real engine core over a tiny model whose runner is the scripted double."""
    config = ModelConfig("LlamaForCausalLM", vocab_size=len(VOCAB), dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                         intermediate_size=16, eos_token_id=EOS, max_seq_len=64)
    engine = Engine(Transformer(config), CharTokenizer(), ServingPlan(block_size=4, num_blocks=16), "cpu")
    engine.runner = ScriptedModelRunner(lm)
    return engine


def engine_freed(engine: Engine) -> bool:
    return not engine.requests and not engine.has_unfinished() and engine.kv.num_free_blocks == 16


def serve_engine(lm, params, leave_after, **_) -> Served:
    engine = scripted_engine(lm)

    async def run():
        events = await consume(EngineAdapter(engine).generate(PROMPT, params), leave_after)
        forwards = await settle(lambda: engine.runner.forwards, engine.has_unfinished)
        return Served(events, forwards, engine_freed(engine))

    return asyncio.run(run())


def serve_onnx(lm, params, leave_after, monkeypatch, per_row: bool, **_) -> Served:
    runner = ScriptedOnnxRunner(lm, [EOS], per_row)
    monkeypatch.setattr(onnx_module, "OnnxRunner", lambda bundle_dir, threads=None: runner)
    monkeypatch.setattr(onnx_module, "load_tokenizer", lambda path: CharTokenizer())
    adapter = OnnxRuntimeAdapter("scripted", threads=1)

    async def run():
        events = await consume(adapter.generate(PROMPT, params), leave_after)
        batcher = adapter.batcher
        running = (lambda: bool(batcher.running or batcher.waiting)) if batcher else adapter._lock.locked
        forwards = 1 + await settle(lambda: runner.decoded_rows, running)  # the prefill and the decodes
        return Served(events, forwards, not running())

    return asyncio.run(run())


def serve_ascend(lm, params, leave_after, monkeypatch, tmp_path, **_) -> Served:
    write_ascend_bundle(tmp_path / "ascend", [EOS], len(VOCAB))
    monkeypatch.setattr(ascend_module, "load_tokenizer", lambda path: CharTokenizer())
    sessions = {}

    def factory(path, dynamic: bool):
        graph = "prefill" if dynamic else "decode"
        return sessions.setdefault(graph, ScriptedOmSession(lm, graph))

    adapter = AscendAdapter(tmp_path / "ascend", session_factory=factory)

    async def run():
        events = await consume(adapter.generate(PROMPT, params), leave_after)
        forwards = await settle(lambda: sessions["prefill"].calls + sessions["decode"].calls, adapter._lock.locked)
        return Served(events, forwards, not adapter._lock.locked())

    return asyncio.run(run())


def serve_triton(lm, params, leave_after, monkeypatch, **_) -> Served:
    """Triton's Python-backend model: the client's request tensors in, its responses out; the client
    leaves by cancelling the request (Triton's ``is_cancelled``) after ``leave_after`` responses."""
    backend = load_triton_backend(monkeypatch)
    engine = scripted_engine(lm)
    monkeypatch.setattr(Engine, "from_artifact", classmethod(lambda cls, *args, **kwargs: engine))
    inputs = {"input_ids": np.array(PROMPT, np.int32), "max_tokens": np.array([params.max_tokens], np.int32),
              "ignore_eos": np.array([params.ignore_eos])}
    if params.stop:
        inputs["stop"] = np.array([s.encode() for s in params.stop], dtype=np.object_)
    model = backend.TritonPythonModel()
    model.initialize(triton_model_args())
    request = TritonRequest(inputs, cancel_after=leave_after)
    model.execute([request])
    try:
        deadline = time.monotonic() + 10
        while not (request.final and engine_freed(engine)) and time.monotonic() < deadline:
            time.sleep(0.01)
        forwards, freed = engine.runner.forwards, engine_freed(engine)
    finally:
        model.finalize()
    ok = [r for r in request.responses if r.error is None]
    events = [event_from_fields(*(r.outputs[k].tolist() for k in ("text_output", "token_ids", "finish_reason")))
              for r in ok]
    if leave_after is not None:  # the client that cancelled is told so, once, after what it read
        assert len(ok) == len(request.responses) - 1 and request.responses[-1].error.code == "CANCELLED"
    return Served(events, forwards, freed)


RUNTIMES = {
    "engine": serve_engine,
    "onnxruntime": lambda *a, **k: serve_onnx(*a, per_row=False, **k),
    "onnxruntime batched": lambda *a, **k: serve_onnx(*a, per_row=True, **k),
    "ascend": serve_ascend,
    "triton model": serve_triton,
}


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("case", list(CASES))
def test_every_runtime_streams_what_the_token_loop_does(runtime, case, monkeypatch, tmp_path):
    script, params, text = CASES[case]
    expected = received(through_request(script, params))
    assert expected[0] == text, "the token loop's text"
    served = RUNTIMES[runtime](ScriptedLM(script, len(PROMPT), len(VOCAB)), params, None,
                               monkeypatch=monkeypatch, tmp_path=tmp_path)
    assert received(served.events) == expected  # text, ids (EOS counted), finish reason, delta by delta
    assert served.freed


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("case", list(ABORTS))
def test_a_client_that_leaves_stops_the_runtime_and_frees_its_request(runtime, case, monkeypatch, tmp_path):
    script, params, leave_after = ABORTS[case]
    expected = through_request(script, params)[:leave_after]
    served = RUNTIMES[runtime](ScriptedLM(script, len(PROMPT), len(VOCAB)), params, leave_after,
                               monkeypatch=monkeypatch, tmp_path=tmp_path)
    assert served.events == expected  # no held-back stop prefix leaks when the client leaves
    # one forward a token: those read, and at most a step or two the runtime had in flight (not the 40 asked for)
    assert served.forwards <= leave_after + 2, f"{served.forwards} forwards for {leave_after} tokens read"
    assert served.freed
