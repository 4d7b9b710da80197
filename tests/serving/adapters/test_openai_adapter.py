"""The OpenAI-compatible adapter and ``qcompile bench openai://…`` against a scripted server on 127.0.0.1.

The server here is a TEST DOUBLE: it answers ``/v1/models`` and streams ``/v1/completions`` the
way vLLM does (one SSE chunk per token with ``token_ids``, then ``data: [DONE]``), generating
``max_tokens`` tokens whose ids count up from the prompt's length, so every count is known.
The real vLLM is driven in tests/backends/vllm/test_vllm_server.py.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from aiohttp import web

from serving.adapters.openai import OpenAIAdapter, OpenAIRequestError, parse_chunk, request_body, served_models
from serving.types import SamplingParams


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ScriptedOpenAIServer:
    """TEST DOUBLE of an OpenAI-compatible server; ``mode`` "ids" (vLLM), "text-only" or "error"."""

    def __init__(self, model: str, mode: str = "ids"):
        self.model, self.mode, self.bodies = model, mode, []
        self.port = _free_port()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        if self.mode == "error":
            return web.json_response({"error": {"message": "max_tokens is too large"}}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        start = len(body["prompt"]) if isinstance(body["prompt"], list) else 1
        for i in range(body["max_tokens"]):
            last = i == body["max_tokens"] - 1
            choice = {"index": 0, "text": f"t{start + i} ", "finish_reason": "length" if last else None}
            if self.mode == "ids":
                choice["token_ids"] = [start + i]
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            await asyncio.sleep(0.002)
        await response.write(b"data: [DONE]\n\n")
        return response

    def __enter__(self):
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        self.runner = web.AppRunner(app)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self):
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"


async def _collect(adapter, prompt, params):
    events = [e async for e in adapter.generate(prompt, params)]
    await adapter.close()
    return events


def test_request_body_carries_ids_lengths_and_sampling():
    body = request_body("m", [3, 4, 5], SamplingParams(max_tokens=7, ignore_eos=True, top_k=5, seed=1, stop=("\n",)))
    assert body["prompt"] == [3, 4, 5] and body["max_tokens"] == 7 and body["ignore_eos"] is True
    assert body["stream"] is True and body["return_token_ids"] is True and body["temperature"] == 0.0
    assert body["top_k"] == 5 and body["seed"] == 1 and body["stop"] == ["\n"]
    assert "top_k" not in request_body("m", "text", SamplingParams())


def test_chunks_become_events_and_errors_are_raised():
    event = parse_chunk({"choices": [{"text": "ab", "token_ids": [7, 8], "finish_reason": None}]})
    assert (event.token_ids, event.text, event.finish_reason) == ([7, 8], "ab", None)
    assert parse_chunk({"choices": [], "usage": {"completion_tokens": 3}}) is None
    assert parse_chunk({"choices": [{"text": "", "finish_reason": "length"}]}).finish_reason == "length"
    with pytest.raises(OpenAIRequestError, match="without token ids"):
        parse_chunk({"choices": [{"text": "ab", "finish_reason": None}]})
    with pytest.raises(OpenAIRequestError, match="engine died"):
        parse_chunk({"error": {"message": "engine died"}})


def test_llama_cpp_servers_ids_come_with_their_logprobs():
    """llama-server streams no token_ids: the adapter asks logprobs: 1 there, whose entries carry each id."""
    assert request_body("m", [1], SamplingParams(), ids_by_logprobs=True)["logprobs"] == 1
    assert "logprobs" not in request_body("m", [1], SamplingParams())
    chunk = {"choices": [{"text": "ab", "finish_reason": None, "logprobs": {"content": [
        {"id": 279, "token": "a", "logprob": -1.7}, {"id": 5, "token": "b", "logprob": -0.2}]}}]}
    assert parse_chunk(chunk).token_ids == [279, 5]


def test_adapter_streams_every_token_with_its_id(tmp_path):
    with ScriptedOpenAIServer("m") as server:
        assert served_models(server.url) == ["m"]
        events = asyncio.run(_collect(OpenAIAdapter(server.url, "m"), [1, 2, 3], SamplingParams(max_tokens=5)))
    assert [e.token_ids for e in events] == [[3], [4], [5], [6], [7]]
    assert [e.finish_reason for e in events] == [None] * 4 + ["length"]
    assert server.bodies[0]["prompt"] == [1, 2, 3] and server.bodies[0]["model"] == "m"


@pytest.mark.parametrize("mode, words", [("error", "HTTP 400: max_tokens is too large"), ("text-only", "without token ids")])
def test_adapter_refuses_what_it_cannot_measure(mode, words):
    with ScriptedOpenAIServer("m", mode) as server:
        with pytest.raises(OpenAIRequestError, match=words):
            asyncio.run(_collect(OpenAIAdapter(server.url, "m"), "hi", SamplingParams(max_tokens=3)))


def test_bench_openai_target_measures_exact_lengths(tmp_path, byte_tokenizer):
    from serving.bench.benchmark import run_benchmark
    from serving.bench.runner import LoadConfig
    from serving.bench.targets import parse_target
    from serving.bench.workload import LengthDist, WorkloadConfig

    model_dir = tmp_path / "served-model"  # vLLM names a model served from a directory by its path
    byte_tokenizer.save_pretrained(model_dir)
    with ScriptedOpenAIServer(str(model_dir)) as server:
        target = parse_target(f"openai://{server.url}")
        assert (target.kind, target.model) == ("openai", str(model_dir))
        workload = WorkloadConfig(LengthDist("fixed", 16), LengthDist("fixed", 6))
        result = run_benchmark(f"openai://{server.url}", workload, [LoadConfig(concurrency=2, num_requests=4, warmup=1)])
    (run,) = result["runs"]
    counts = run["metrics"]["counts"]
    assert counts["successful"] == 4 and counts["output_tokens"] == 24 and counts["output_length_mismatch"] == 0
    assert run["metrics"]["time_to_first_token"]["count"] == 4 and run["metrics"]["inter_token_latency"]["count"] == 20
    assert all(len(b["prompt"]) == 16 and b["ignore_eos"] for b in server.bodies)  # token ids, exact lengths


def test_openai_target_with_several_models_must_name_one():
    from serving.bench.errors import BenchError
    from serving.bench.targets import parse_target

    assert parse_target("openai://127.0.0.1:9/m").model == "m"  # named: no request needed
    with pytest.raises(BenchError, match="is an OpenAI-compatible server running there"):
        parse_target(f"openai://127.0.0.1:{_free_port()}")
